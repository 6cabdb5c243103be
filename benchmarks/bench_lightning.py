#!/usr/bin/env python
"""Lightning on a group against Lightning's own ``ddp_notebook``: the first fit and later ones.

    python benchmarks/bench_lightning.py [--quick] [--out bench_lightning_results.json]

The same tiny ``LightningModule`` (a Linear(8, 1), 4 batches of 16, one epoch, no logger,
checkpoint or progress bar), defined in this script as it would be in a notebook, trained on 2 CPU
processes over gloo. Round by round, interleaved:

* ``ddp_notebook``: ``Trainer(strategy="ddp_notebook", devices=2).fit(...)`` three times in a child
  process that has imported Lightning (as a kernel has): each fit forks its two processes.
* nbdist, each case on a fresh group of 2 (the start is not timed), ``nbdist.lightning.fit``:
  ``cold`` -- the first fit on a group whose ranks never imported Lightning (before issue 17);
  ``warm_now`` -- :func:`nbdist.lightning.warm` (what the notebook does after the cell that imports
  Lightning), then the fit at once; ``run_all`` -- what "Run All" does: the notebook warms the ranks
  before the cell that imports Lightning runs, the kernel imports it (here: a fresh
  ``python -c "import pytorch_lightning"`` stands for that cell, timed as ``import_cell``), then the
  fit; ``warm_3s`` -- warmed 3 s before the fit (a user reading or typing); ``later`` -- the second
  and third fits on a group. ``import_cell_alone`` is the same import with no ranks importing.

Target (issue 17): the first fit no slower than ``ddp_notebook`` plus 0.5 s.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

FULL = dict(rounds=5)
QUICK = dict(rounds=2)
TRAINER = dict(max_epochs=1, enable_checkpointing=False, logger=False, enable_progress_bar=False,
               enable_model_summary=False)


def _module_and_data():
    import pytorch_lightning as pl
    import torch

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch, i):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def data():
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(64, 8, generator=gen)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)),
                                           batch_size=16)
    return Tiny, data


def _ddp_notebook_child(fits: int) -> None:
    import pytorch_lightning as pl

    Tiny, data = _module_and_data()
    out = []
    for _ in range(fits):
        t0 = time.perf_counter()
        pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_notebook", **TRAINER).fit(Tiny(),
                                                                                         data())
        out.append(time.perf_counter() - t0)
    harness.emit(out)


def _ddp_notebook(fits: int = 3):
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--ddp-notebook-child",
                           str(fits)], capture_output=True, text=True, timeout=300,
                          env=harness.loopback_env())
    for line in proc.stdout.splitlines():
        if line.startswith(harness.RESULT_TAG):
            return json.loads(line[len(harness.RESULT_TAG):])
    raise RuntimeError(f"the ddp_notebook child failed:\n{proc.stderr[-3000:]}")


def _nbdist_case(case: str):
    import nbdist
    import nbdist.lightning as nl

    Tiny, data = _module_and_data()
    with nbdist.start(2, backend="gloo", device="cpu", timeout=120) as g:
        extra = None
        if case != "cold":
            assert nl.warm(g)
            if case == "warm_3s":
                time.sleep(3.0)
            elif case == "run_all":
                extra = _import_cell()
        times = []
        for _ in range(3 if case == "cold" else 1):
            t0 = time.perf_counter()
            nl.fit(g, Tiny, data, **TRAINER)
            times.append(time.perf_counter() - t0)
    return times, extra


def _import_cell() -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import pytorch_lightning"], check=True, timeout=120)
    return time.perf_counter() - t0


def run(cfg):
    res = {k: [] for k in ("ddp_notebook_first", "ddp_notebook_later", "cold", "warm_now",
                           "run_all", "warm_3s", "later", "import_cell", "import_cell_alone")}
    for r in range(cfg["rounds"]):
        harness.log(f"  round {r + 1}/{cfg['rounds']}")
        nb = _ddp_notebook()
        res["ddp_notebook_first"].append(nb[0])
        res["ddp_notebook_later"] += nb[1:]
        cold, _ = _nbdist_case("cold")
        res["cold"].append(cold[0])
        res["later"] += cold[1:]
        res["warm_now"] += _nbdist_case("warm_now")[0]
        fit, imported = _nbdist_case("run_all")
        res["run_all"] += fit
        res["import_cell"].append(imported)
        res["import_cell_alone"].append(_import_cell())
        res["warm_3s"] += _nbdist_case("warm_3s")[0]
    out = {k: harness.summary(v) for k, v in res.items()}
    ddp = out["ddp_notebook_first"]
    for case in ("cold", "warm_now", "run_all", "warm_3s"):
        out[f"{case}_minus_ddp_notebook_s"] = (out[case]["median"] - ddp["median"]
                                               if out[case].get("n") and ddp.get("n") else None)
    out["later_over_ddp_notebook_later"] = harness.ratio(out["later"], out["ddp_notebook_later"])
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--ddp-notebook-child"]:
        _ddp_notebook_child(int(argv[1]))
        return 0
    ap = harness.arg_parser(__doc__, "bench_lightning_results.json")
    args = ap.parse_args(argv)
    if not harness.have("pytorch_lightning", "the Lightning benchmark"):
        return 0
    cfg = QUICK if args.quick else FULL
    res = {"meta": harness.machine_info(config=cfg), "lightning": run(cfg)}
    r = res["lightning"]
    for key, label in (("ddp_notebook_first", "ddp_notebook, first fit"),
                       ("ddp_notebook_later", "ddp_notebook, later fits"),
                       ("cold", "nbdist first fit, cold ranks"),
                       ("warm_now", "nbdist first fit, warmed, at once"),
                       ("run_all", "nbdist first fit, Run All"),
                       ("import_cell", "  its import cell, ranks importing too"),
                       ("import_cell_alone", "  the import cell alone"),
                       ("warm_3s", "nbdist first fit, warmed 3 s before"),
                       ("later", "nbdist later fits")):
        print(f"{label:38s} {harness.fmt_summary(r[key])}")
    for case in ("cold", "warm_now", "run_all", "warm_3s"):
        d = r[f"{case}_minus_ddp_notebook_s"]
        print(f"{case:8s} minus ddp_notebook first fit: "
              f"{'-' if d is None else f'{d:+.2f} s'} (target <= +0.5 s)")
    print(f"later fits / ddp_notebook later fits: {r['later_over_ddp_notebook_later']:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
