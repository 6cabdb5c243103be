"""An attached group listens on the one address the user chose, never on all interfaces -- its
control listener and every rendezvous store it hosts (issue 25, security): the first generation's
and the one torchrun's restart joins."""
import ipaddress

import psutil
import pytest

import nbdist

from attach_helpers import Cluster

pytestmark = pytest.mark.timeout(240)


def listening():
    """``(address, port)`` of every TCP socket this process listens on."""
    return sorted((c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("inet")
                  if c.status == psutil.CONN_LISTEN)


def assert_only_on(address, sockets):
    assert sockets, "expected the group's listeners"
    wild = [s for s in sockets if ipaddress.ip_address(s[0]) != ipaddress.ip_address(address)]
    assert wild == [], f"listening beyond {address}: {wild} (all: {sockets})"


def test_every_port_of_an_attached_group_is_on_the_chosen_address(tmp_path):
    before = listening()
    c = Cluster(tmp_path, nnodes=2, nproc=1, max_restarts=1, protect=True)
    try:
        g = c.group
        ours = [s for s in listening() if s not in before]
        assert_only_on("127.0.0.1", ours)
        assert len(ours) == 2  # the control listener and the rendezvous store
        with pytest.raises(nbdist.RankDiedError):
            g.exec("import os\nif rank == 1:\n    os._exit(3)\nt = torch.ones(1); dist.all_reduce(t)")
        assert g.run(lambda: 1) == [1, 1]  # generation 2, with a rendezvous store of its own
        assert "generation 2" in repr(g)
        assert_only_on("127.0.0.1", [s for s in listening() if s not in before])
    finally:
        c.close(wait=5)
    assert [s for s in listening() if s not in before] == []
