import sys, time
from jupyter_client.manager import KernelManager
t0 = time.time()
km = KernelManager(kernel_name="python3")
km.start_kernel()
kc = km.client(); kc.start_channels(); kc.wait_for_ready(timeout=300)
print("kernel ready", time.time() - t0, flush=True)
def hook(msg):
    c = msg["content"]
    if msg["msg_type"] == "stream": print("[%s]" % c["name"], c["text"], end="")
    elif msg["msg_type"] in ("execute_result", "display_data"): print(c["data"].get("text/plain"))
    elif msg["msg_type"] == "error": print("ERROR", c["ename"], c["evalue"])
for code in ["%load_ext nbdist", "%dist_start -n 2",
             "%%dist\nimport torch, torch.distributed as dist\nt = torch.ones(2) * (rank + 1)\ndist.all_reduce(t)\nprint(rank, t.tolist())",
             "%dist_stop"]:
    r = kc.execute_interactive(code, output_hook=hook, timeout=600)
    print("---", code.splitlines()[0], r["content"]["status"], round(time.time() - t0, 1), flush=True)
kc.stop_channels(); km.shutdown_kernel(now=False)
print("took", time.time() - t0)
