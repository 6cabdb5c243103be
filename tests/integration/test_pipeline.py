"""Pipelines on real ranks (2, gloo): losses, the local stages' gradients and weights match one
process; bad arguments give clear errors on every rank and leave the group usable; a timed step
gives a timeline (issue 19)."""
import sys

import cloudpickle
import pytest
import torch

import nbdist
from nbdist.parallel import Timeline

pytestmark = pytest.mark.timeout(120)
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import this file


def make_model(layers=8, width=16):
    torch.manual_seed(0)
    mods = []
    for i in range(layers):
        mods.append(torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()))
    return torch.nn.Sequential(*mods)


def batch(n=8, width=16):
    gen = torch.Generator().manual_seed(1)
    return torch.randn(n, width, generator=gen), torch.randn(n, width, generator=gen)


def train(schedule, microbatches, steps=2, split=None, layers=8):
    """Train the pipeline and one process side by side; compare the loss, the local stages'
    gradients at every step and their weights at the end."""
    import copy
    import functools

    from nbdist.parallel import pipeline

    model = make_model(layers)
    reference = copy.deepcopy(model)
    x, y = batch()
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    pipe = pipeline(model, schedule, microbatches, loss_fn=torch.nn.functional.mse_loss,
                    split=split, optimizer_fn=sgd)
    ref_opt = sgd(reference.parameters())
    held = [i for layers_ in pipe.layers.values() for i in layers_]
    losses, ref_losses, grad_errors = [], [], []
    for _ in range(steps):
        losses.append(pipe.step(x, y))  # zero_grad, forward/backward, optimizer.step: the
        ref_opt.zero_grad()             # local stages' .grad stay those of this step
        loss = torch.nn.functional.mse_loss(reference(x), y)
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
        grad_errors.append(max((p.grad - q.grad).abs().max().item() for i in held
                               for p, q in zip(model[i].parameters(), reference[i].parameters())))
    error = max((p - q).abs().max().item() for i in held
                for p, q in zip(model[i].parameters(), reference[i].parameters()))
    changed = all(not torch.equal(p, q) for i in held
                  for p, q in zip(model[i].parameters(), make_model(layers)[i].parameters()))
    return dict(losses=losses, ref_losses=ref_losses, error=error, held=held, changed=changed,
                grad_errors=grad_errors,
                stages=pipe.stages, last=pipe.last,
                optimizer_params=sum(len(g["params"]) for g in pipe.optimizer.param_groups),
                local_params=sum(1 for m in pipe.stage_modules for _ in m.parameters()))


def check_like_one_process(out, layers=8):
    world = len(out)
    assert sorted(i for r in out for i in r["held"]) == list(range(layers))  # every layer once
    for rank, r in enumerate(out):
        assert max(r["grad_errors"]) < 1e-5, r["grad_errors"]  # the local layers' gradients
        assert r["error"] < 1e-6  # the local stages' weights after 2 SGD steps
        assert r["changed"]  # ... which did train
        assert r["optimizer_params"] == r["local_params"]
        if r["last"]:
            assert r["losses"] == pytest.approx(r["ref_losses"], abs=1e-6)
            assert r["losses"][1] < r["losses"][0]
        else:
            assert r["losses"] == [None, None]
    assert [r["last"] for r in out].count(True) == 1
    return world


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("microbatches", [2, 4])
def test_pipeline_trains_like_one_process(shared_group, schedule, microbatches):
    out = shared_group.run(train, schedule, microbatches)
    check_like_one_process(out)
    assert [r["held"] for r in out] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # even split by layer count


def test_interleaved_runs_two_stages_per_rank_like_one_process(shared_group):
    out = shared_group.run(train, "interleaved1f1b", 4)
    check_like_one_process(out)
    assert [r["stages"] for r in out] == [[0, 2], [1, 3]]
    assert [r["held"] for r in out] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert out[1]["last"]


def test_explicit_split_points(shared_group):
    out = shared_group.run(train, "1f1b", 2, split=[3])
    check_like_one_process(out)
    assert [r["held"] for r in out] == [[0, 1, 2], [3, 4, 5, 6, 7]]


def stages_given_as_a_list():
    from nbdist.parallel import pipeline

    model = make_model(4)
    stages = [model[:1], model[1:]]
    pipe = pipeline(stages, "gpipe", 2, loss_fn=torch.nn.functional.mse_loss)
    x, y = batch()
    return pipe.step(x, y), pipe.layers, torch.nn.functional.mse_loss(model(x), y).item()


def test_a_model_given_as_one_module_per_stage(shared_group):
    (l0, layers0, _), (l1, layers1, before) = shared_group.run(stages_given_as_a_list)
    assert l0 is None and l1 == pytest.approx(before, rel=0.2)  # the loss before the step
    assert layers0 == {0: [0]} and layers1 == {1: [1]}


def errors_then_a_good_step():
    """Every mistake raises before anything is sent, on every rank; then a step still works."""
    from nbdist.parallel import pipeline

    mse = torch.nn.functional.mse_loss
    bad = {
        "schedule": lambda: pipeline(make_model(), "zb1p", 4, loss_fn=mse),
        "layers": lambda: pipeline(make_model(3), "interleaved1f1b", 4, loss_fn=mse),
        "split": lambda: pipeline(make_model(), "1f1b", 4, loss_fn=mse, split=[9]),
        "split_count": lambda: pipeline(make_model(), "1f1b", 4, loss_fn=mse, split=[2, 4]),
        "microbatches": lambda: pipeline(make_model(), "1f1b", 1, loss_fn=mse),
        "rounds": lambda: pipeline(make_model(), "interleaved1f1b", 5, loss_fn=mse),
        "not_sequential": lambda: pipeline(torch.nn.Linear(4, 4), "1f1b", 4, loss_fn=mse),
        "loss_fn": lambda: pipeline(make_model(), "1f1b", 4, loss_fn=None),
        "stage_count": lambda: pipeline([make_model(2)], "gpipe", 2, loss_fn=mse),
        "split_of_a_list": lambda: pipeline(list(make_model(2)), "gpipe", 2, loss_fn=mse,
                                            split=[1]),
        "not_modules": lambda: pipeline([make_model(1), "layer"], "gpipe", 2, loss_fn=mse),
        "optimizer_fn": lambda: pipeline(make_model(), "1f1b", 4, loss_fn=mse,
                                         optimizer_fn="sgd"),
    }
    messages = {}
    for key, build in bad.items():
        try:
            build()
        except (TypeError, ValueError) as err:
            messages[key] = f"{type(err).__name__}: {err}"
    pipe = pipeline(make_model(), "1f1b", 4, loss_fn=mse)
    x, y = batch(6)
    try:
        pipe.step(x, y)  # 6 rows do not split into 4 microbatches
    except ValueError as err:
        messages["batch"] = str(err)
    x, y = batch(8)
    try:
        pipe.step(None, y)  # the first stage's rank without its inputs
    except ValueError as err:
        messages["no_x"] = str(err)
    first = pipe.step(x, y)
    x, y = batch(12)
    try:
        pipe.step(x, y)  # another batch size than the first step's
    except ValueError as err:
        messages["batch_size_changed"] = str(err)
    x, y = batch(8)
    return messages, first, pipe.step(x, y)


def test_bad_arguments_fail_on_every_rank_and_leave_the_group_usable(shared_group):
    out = shared_group.run(errors_then_a_good_step)
    assert out[0][0] == out[1][0]  # the same errors on both ranks
    m = out[0][0]
    assert "unknown pipeline schedule 'zb1p'; valid schedules: gpipe, 1f1b, interleaved1f1b" \
        in m["schedule"]
    assert "the model has 3 layers but the pipeline has 4 stages (2 ranks x 2 per rank)" \
        in m["layers"]
    assert "split=[9] is not valid" in m["split"] and "1..7 (e.g. split=[4])" in m["split"]
    assert "2 stages of a 8-layer model need 1 increasing ints" in m["split_count"]
    assert ("schedule '1f1b' needs at least as many microbatches as stages (torch's "
            "Schedule1F1B): 2 stages, microbatches=1") in m["microbatches"]
    assert "needs microbatches to be a multiple of max(1, microbatches // ranks) = 2" \
        in m["rounds"]
    assert m["not_sequential"].startswith("TypeError: pipeline() splits an nn.Sequential by "
                                          "layer count, got Linear. Pass its layers in order")
    assert "loss_fn must be a callable (output, target) -> loss" in m["loss_fn"]
    assert "1 stage modules for 2 stages (2 ranks): pass one module per stage" in m["stage_count"]
    assert m["split_of_a_list"] == ("ValueError: split= applies to an nn.Sequential; a list of "
                                    "modules is already one module per stage")
    assert m["not_modules"] == ("TypeError: a model given as a list must hold one nn.Module per "
                                "stage")
    assert m["optimizer_fn"] == ("TypeError: optimizer_fn must build the optimizer from "
                                 "parameters, e.g. functools.partial(torch.optim.SGD, lr=0.1); "
                                 "got str")
    assert m["no_x"] == out[1][0]["no_x"] == (
        "pipeline step refused before anything ran; rank 0: x must be a batch tensor on the rank "
        "of the first stage, got NoneType")
    assert m["batch"] == out[1][0]["batch"]  # both ranks refused, both ranks' problems named
    assert ("pipeline step refused before anything ran; rank 0: the batch of 6 (x) does not "
            "split into 4 equal microbatches") in m["batch"]
    assert "rank 1: the batch of 6 (y)" in m["batch"]
    assert ("rank 0: the batch of 12 (x) differs from the first step's (8): the stages' buffers "
            "are shaped on the first step; build a new pipeline") in m["batch_size_changed"]
    assert out[0][1] is None and out[0][2] is None
    assert out[1][2] < out[1][1]  # the pipeline kept training after the refused steps
    assert shared_group.run(lambda: 1) == [1, 1]


def test_an_error_on_the_ranks_reaches_the_notebook(shared_group):
    def build():
        from nbdist.parallel import pipeline

        pipeline(make_model(), "1F1B ", 4, loss_fn=torch.nn.functional.mse_loss)

    with pytest.raises(nbdist.RemoteError, match="unknown pipeline schedule '1F1B '"):
        shared_group.run(build)
    assert shared_group.run(lambda: 2) == [2, 2]


def timed(schedule, microbatches):
    from nbdist.parallel import pipeline

    pipe = pipeline(make_model(), schedule, microbatches, loss_fn=torch.nn.functional.mse_loss)
    x, y = batch()
    tl = pipe.timeline(x, y)
    return tl, pipe.steps, pipe.last_timeline is tl


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved1f1b"])
def test_timeline_times_every_microbatch_on_every_rank(shared_group, schedule):
    out = shared_group.run(timed, schedule, 4)
    assert [steps for _, steps, _ in out] == [2, 2]  # one warm-up step, one recorded
    assert all(same for _, _, same in out)
    tl = Timeline.merge(t for t, _, _ in out)
    stages = 4 if schedule == "interleaved1f1b" else 2
    assert len(tl) == stages * 4 * 2  # forward + backward of 4 microbatches on every stage
    for stage in range(stages):
        for kind in ("forward", "backward"):
            mbs = sorted(e["microbatch"] for e in tl.events
                         if e["stage"] == stage and e["kind"] == kind)
            assert mbs == [0, 1, 2, 3]
    assert all(e["end"] >= e["start"] for e in tl.events)
    b = tl.bubble()
    assert b["theory"] == pytest.approx(1 / 5 if stages == 2 else 1 / 9)
    assert 0 <= b["measured"] < 1 and sorted(b["per_rank"]) == [0, 1]
    assert 0 <= tl.replay()["bubble"] < 1
    held = {"gpipe": {0: 4, 1: 4}, "1f1b": {0: 2, 1: 1}}  # GPipe holds all m; 1F1B p - rank
    if schedule in held:
        assert tl.in_flight() == held[schedule]
    text = repr(tl)
    assert "idle share (%)" in text and "bubble: measured" in text
    assert "<table>" in tl._repr_html_()
    assert sorted(tl.spans) == [0, 1]


def test_memory_measure_pp_reports_each_stage_against_its_formula(shared_group):
    import functools

    from nbdist.memory import measure, mlp

    report = measure(shared_group, functools.partial(mlp, 4, 64), strategies=["pp"],
                     optimizer="adam", batch=8,
                     options={"pp": {"schedule": "gpipe", "microbatches": 4}})
    assert [r.rank for r in report] == [0, 1]
    total = report[0].num_params
    assert sum(r.local_params for r in report) == total  # the stages cover the model once
    for r in report:
        assert r.params == 4 * r.local_params and r.grads == 4 * r.local_params
        assert r.optimizer >= 8 * r.local_params  # Adam's two moments (+ its step counters)
        assert abs(r.diff) < 1e-3
        assert r.formula.startswith("PP: the stage's layers: (P + G + K)Ψ_stage = 16Ψ_stage")
    assert report[0].layers == "stage 0: layers 0-3 of 7 (gpipe, 4 microbatches)"
    text = report.table()
    # the formula once, every rank's stage on one line (issue 35: one formula per rank made
    # tutorial 10's caption 15 lines long)
    note = [line for line in text.splitlines() if line.startswith("pp: PP: the stage's layers")]
    assert len(note) == 1 and "Ψ=" in note[0] and "in 7 layers, N=2; gpipe, 4 microbatches)" \
        in note[0], text
    assert note[0].endswith(f"rank 0: stage 0: layers 0-3, Ψ_stage={report[0].local_params:,}; "
                            f"rank 1: stage 1: layers 4-6, Ψ_stage={report[1].local_params:,}")


def test_pipeline_in_the_kernel_says_where_to_call_it():
    import torch.distributed as dist

    from nbdist.parallel import pipeline

    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="pipeline\\(\\) needs torch.distributed initialised: "
                       "call it on the ranks, e.g. in %%dist or group.run\\(fn\\)"):
        pipeline(make_model(), "1f1b", 4, loss_fn=torch.nn.functional.mse_loss)


def test_strategy_pp_points_to_the_pipeline_for_training(shared_group):
    def wrap_pp():
        from nbdist import strategies

        strategies.wrap("pp", make_model(), torch.optim.SGD)

    with pytest.raises(nbdist.RemoteError, match="strategy 'pp' \\(pipeline parallelism\\) does "
                       "not wrap a model .* train with nbdist.parallel.pipeline"):
        shared_group.run(wrap_pp)
    from nbdist.memory import measure, mlp

    with pytest.raises(nbdist.RemoteError, match="strategy 'pp' takes the options schedule, "
                       "microbatches, split, stages_per_rank, got chunks"):
        measure(shared_group, mlp, strategies=["pp"], options={"pp": {"chunks": 4}})
    with pytest.raises(nbdist.RemoteError, match="strategy 'pp' measures fp32 only: keep "
                       "precision='fp32'"):
        measure(shared_group, mlp, strategies=["pp"], precision="bf16-mixed")
    assert shared_group.run(lambda: 3) == [3, 3]
