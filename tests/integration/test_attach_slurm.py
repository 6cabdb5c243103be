"""The srun path without SLURM (issue 20): ``python -m nbdist.worker`` processes started directly,
with the environment srun gives each task -- two "nodes" (SLURM_NODEID 0 and 1), one task each --
join a notebook-side :func:`nbdist.attach` group. Node labels come from SLURM_NODEID."""
import os
import socket
import subprocess
import sys
import threading

import pytest
from attach_helpers import _die_with_parent, free_port, wait_for

import nbdist

pytestmark = pytest.mark.timeout(180)

# What torchrun or an enclosing launcher may have left in the test's environment: not srun's.
_NOT_SRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
             "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "PMI_RANK", "PMI_SIZE")


def srun_task(rank, ntasks, port, key_file):
    """One task as srun starts it: ``python -m nbdist.worker`` with SLURM's variables."""
    env = {k: v for k, v in os.environ.items()
           if k not in _NOT_SRUN and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", SLURM_PROCID=str(rank), SLURM_NTASKS=str(ntasks),
               SLURM_LOCALID="0", SLURM_NODEID=str(rank), SLURM_JOB_ID="4242", SLURM_STEP_ID="0",
               SLURM_NTASKS_PER_NODE="1", SLURM_NNODES=str(ntasks), SLURM_JOB_NUM_NODES=str(ntasks),
               SLURM_NODELIST=f"node[0-{ntasks - 1}]", SLURMD_NODENAME=f"node{rank}",
               SLURM_CPUS_ON_NODE="1", SLURM_LAUNCH_NODE_IPADDR="127.0.0.1")
    return subprocess.Popen([sys.executable, "-m", "nbdist.worker", "--connect",
                             f"127.0.0.1:{port}", "--key-file", key_file], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_die_with_parent)


@pytest.fixture
def slurm(tmp_path):
    """Two srun tasks on two "nodes", attached; every task process ends with the test."""
    port, key_file, box = free_port(), str(tmp_path / "key.hex"), {}

    def attach():
        try:
            box["group"] = nbdist.attach(2, listen=f"127.0.0.1:{port}", key_file=key_file,
                                         join_timeout=120, progress=False, timeout=30)
        except BaseException as err:  # noqa: BLE001 -- re-raised in the test thread
            box["error"] = err

    thread = threading.Thread(target=attach)
    thread.start()
    wait_for(key_file)
    tasks = [srun_task(r, 2, port, key_file) for r in range(2)]
    try:
        thread.join(150)
        if "error" in box:
            raise box["error"]
        yield box["group"], tasks
    finally:
        if "group" in box:
            box["group"].stop()
        for p in tasks:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                p.wait()
            p.stderr.close()


def test_srun_tasks_join_with_node_labels_from_slurm_nodeid(slurm):
    g, tasks = slurm
    assert (g.backend, g.device) == ("gloo", "cpu")  # "auto", resolved on the tasks
    assert g.exec("t = torch.ones(2) * (rank + 1); dist.all_reduce(t); t.tolist()") == \
        [[3.0, 3.0]] * 2
    assert g.run(lambda: (os.environ["SLURM_PROCID"], os.environ["LOCAL_RANK"])) == \
        [("0", "0"), ("1", "0")]
    status = g.status()
    assert [r.node for r in status.ranks] == ["0", "1"]
    header, row1 = str(status).splitlines()[1], str(status).splitlines()[3]
    assert header.split()[:4] == ["rank", "pid", "host", "node"]
    assert row1.split()[:4] == ["1", str(tasks[1].pid), socket.gethostname(), "1"]
    # a Python error names the node it happened on, and the group stays usable
    with pytest.raises(nbdist.RemoteError) as info:
        g.exec("if rank == 1:\n    raise ValueError('boom on the second node')")
    assert str(info.value).startswith(f"ValueError on rank 1 (node 1, host {socket.gethostname()})"
                                      ": boom on the second node")
    assert f"--- rank 1 (node 1, host {socket.gethostname()}) ---" in \
        "\n".join(info.value._render_traceback_())
    assert g.run(lambda: 1) == [1, 1]


def test_printed_output_names_the_node_of_one_rank(slurm, capsys):
    g, _ = slurm
    capsys.readouterr()
    g.exec("print(f'loss {rank / 4}')")
    out = capsys.readouterr().out
    assert "[rank 0, node 0] loss 0.0\n" in out and "[rank 1, node 1] loss 0.25\n" in out
    g.exec("print('the same line on both nodes')")
    assert "[ranks 0, 1] the same line on both nodes\n" in capsys.readouterr().out
    g.dedupe_output = False  # every line as written: still with its node
    g.exec("print('unfolded')")
    out = capsys.readouterr().out
    assert "[rank 0, node 0] unfolded\n" in out and "[rank 1, node 1] unfolded\n" in out


def test_a_task_that_dies_is_reported_with_its_node_and_no_task_stays(slurm):
    g, tasks = slurm
    with pytest.raises(nbdist.RankDiedError) as info:
        g.exec("import os, sys\nif rank == 1:\n"
               "    print('node going down', file=sys.stderr, flush=True); os._exit(3)\n"
               "t = torch.ones(10); dist.all_reduce(t)")
    text = str(info.value)
    assert text.startswith(f"rank 1 (node 1, host {socket.gethostname()}) lost its connection")
    header = f"--- rank 1 (node 1, host {socket.gethostname()}) stderr (last lines) ---\n"
    assert header in text
    # the task's last stderr lines: ours, after whatever torch printed before it (on a host whose
    # name does not resolve, gloo's "Unable to resolve hostname" warning)
    assert "node going down" in text.split(header, 1)[1].split("\nThe group failed")[0].splitlines()
    assert g.state == "broken"
    assert tasks[1].wait(30) == 3
    tasks[0].wait(30)  # the other task ends too (its all_reduce failed or it was killed)
