"""A control channel is torn per direction (issue 34, risk 7): a debugger's thread now sends on a
channel another thread reads, and one flag for both let a whole send hide a half-read message."""
import pickle
import threading

import pytest

from loopback import tcp_pair

from nbdist.wire import transport
from nbdist.wire.deadline import Deadline, poll_until

pytestmark = pytest.mark.timeout(30)



def test_a_whole_send_does_not_hide_a_message_half_read_on_another_thread():
    """Was: ``Channel.torn`` was one flag; the send set it and cleared it, so while the reading
    thread was halfway through a message the channel said it was whole."""
    a, b = tcp_pair()
    channel = transport.Channel(a)
    got = {}
    body = pickle.dumps(("ok", 1, "x" * 100, []))
    reader = threading.Thread(target=lambda: got.setdefault("msg", channel.recv()))
    try:
        b.sendall(transport._HEADER.pack(len(body)) + body[:10])
        reader.start()
        assert poll_until(lambda: channel.torn, lambda left: reader.join(min(left, 0.01)),
                          Deadline(10.0)), "the read never began"
        channel.send(("pdb_cmd", 1, "c"))  # the debugger's thread: a whole message goes out
        assert channel.torn, "a send from another thread cleared the half-read message's flag"
        b.sendall(body[10:])
        reader.join(10)
        assert got["msg"] == ("ok", 1, "x" * 100, []) and not channel.torn
        assert transport.Channel(b).recv() == ("pdb_cmd", 1, "c")
    finally:
        reader.join(10)
        a.close()
        b.close()
