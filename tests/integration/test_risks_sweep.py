"""On a shared machine (JupyterHub, a lab server) another user's leftovers in the sticky /dev/shm and
temp dir never stop a start, and stay where they are; this user's leftovers of a dead caller are
swept. Real users: root leaves the files, ``nobody`` (uid 65534) starts a real group."""
import glob
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

pytestmark = pytest.mark.timeout(180)

NOBODY = 65534
SHM = "/dev/shm"

# What the unprivileged user runs: a real start, one call, a stop. It first checks that it really
# cannot remove root's files (the whole point), then prints its group id.
CHILD = textwrap.dedent("""
    import os, sys
    canary = sys.argv[1]
    try:
        os.unlink(canary)
        raise SystemExit("CANARY-REMOVED: this user can remove root's files, the test proves nothing")
    except PermissionError:
        pass
    import nbdist
    with nbdist.start(1, backend="gloo", device="cpu", timeout=60) as g:
        assert g.run(lambda: 41 + 1) == [42]
        print("GROUP", g.id, flush=True)
""")


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _runner(env):
    """The command prefix that runs this venv's Python as ``nobody``, or skip saying why.

    Plain ``user=`` when ``nobody`` can read the interpreter and the repository. Where the
    interpreter sits under a root-only directory (pyenv in /root), ``setpriv`` keeps only
    CAP_DAC_READ_SEARCH (read any file): it gives no right to remove another user's file from a
    sticky directory (that is CAP_FOWNER), which the child checks before it starts.
    """
    if sys.platform != "linux" or not os.path.isdir(SHM):
        pytest.skip("needs Linux with /dev/shm")
    if os.geteuid() != 0:
        pytest.skip("needs root: the test plays two users (root leaves files, nobody starts)")
    probe = [sys.executable, "-c", "import nbdist, torch"]
    plain = {"user": NOBODY, "group": NOBODY, "extra_groups": []}
    why = _fails(probe, env, plain)
    if why is None:
        return plain, []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip(f"user {NOBODY} cannot run {sys.executable} with nbdist and torch ({why}) "
                    "and there is no setpriv to lend it read access only")
    prefix = [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
              "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
    why_capped = _fails(prefix + probe, env, {})
    if why_capped is not None:
        pytest.skip(f"user {NOBODY} cannot run {sys.executable} with nbdist and torch ({why}), "
                    f"not even with read access lent by setpriv ({why_capped})")
    return {}, prefix


def _fails(cmd, env, kwargs):
    """Why ``cmd`` fails, or None when it runs."""
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120,
                              **kwargs)
    except OSError as err:
        return f"{type(err).__name__}: {err}"
    if proc.returncode != 0:
        return (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
    return None


@pytest.fixture
def shared_machine():
    """A sticky temp dir like /tmp (private, so that the starts of other tests on this machine do
    not sweep the leftovers planted here), a home for ``nobody``, and cleanup of all of it."""
    tmp = tempfile.mkdtemp(prefix="nbdist-risk-tmp-")
    os.chmod(tmp, 0o1777)
    home = tempfile.mkdtemp(prefix="nbdist-risk-home-")
    os.chown(home, NOBODY, NOBODY)
    made = []
    env = {"HOME": home, "TMPDIR": tmp, "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "LANG": "C.UTF-8"}
    try:
        yield tmp, env, made
    finally:
        for path in made:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)


def _leftovers(tmp, owner, made):
    """What a caller killed by SIGKILL leaves: its temp dir (with the rendezvous file in it) and a
    segment, named for a pid that no longer runs, owned by ``owner``."""
    gid = secrets.token_hex(4)
    pid = _dead_pid()
    tdir = tempfile.mkdtemp(prefix=f"nbdist-{gid}-p{pid}-", dir=tmp)
    store = os.path.join(tdir, "store")
    seg = os.path.join(SHM, f"nbdist-{gid}-c-{pid}-0")
    made.append(seg)
    for path in (store, seg):
        with open(path, "wb") as f:
            f.write(b"x" * 4096)
        os.chmod(path, 0o600)
    for path in (tdir, store, seg):
        os.chown(path, owner, owner)
    return gid, tdir, seg


def test_another_users_leftovers_do_not_stop_a_start_and_ours_are_swept(shared_machine):
    tmp, env, made = shared_machine
    kwargs, prefix = _runner(env)
    _, root_dir, root_seg = _leftovers(tmp, 0, made)
    _, own_dir, own_seg = _leftovers(tmp, NOBODY, made)
    canary = os.path.join(SHM, f"nbdist-risk-canary-{secrets.token_hex(4)}")
    made.append(canary)
    open(canary, "wb").close()

    proc = subprocess.run(prefix + [sys.executable, "-c", CHILD, canary], env=env, cwd=tmp,
                          capture_output=True, text=True, timeout=150, **kwargs)

    assert proc.returncode == 0, f"start as another user failed:\n{proc.stdout}\n{proc.stderr}"
    gid = proc.stdout.split("GROUP", 1)[1].split()[0]
    # root's leftovers are root's: still there, untouched
    assert os.path.exists(root_seg) and os.path.isdir(root_dir)
    assert os.stat(root_seg).st_uid == 0 and os.path.exists(canary)
    # the same user's leftovers of a dead caller are swept
    assert not os.path.exists(own_seg) and not os.path.exists(own_dir)
    # and the group that ran leaves nothing behind
    assert glob.glob(os.path.join(SHM, f"nbdist-{gid}-*")) == []
    assert glob.glob(os.path.join(tmp, f"nbdist-{gid}-*")) == []
