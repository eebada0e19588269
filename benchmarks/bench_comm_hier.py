"""Cross-node bytes of stage 3 with hierarchical partitioning (node_size), quantized
parameter gathers and quantized gradients, against exact stage 3 in bf16 (the
baseline ZeRO++ compares against), 4 gloo ranks acting as 2 nodes of 2; and the
bytes the loopback interface actually carried against what the counters say.

    python benchmarks/bench_comm_hier.py                 # 4 ranks, nodes of 2, 6 measured steps
    python benchmarks/bench_comm_hier.py --no-netns      # on the shared loopback (noisy)

Modes (all stage 3, param_dtype and reduce_dtype bf16, GPT 6 layers / n_embd 128 /
block 64, one unit per Block, batch 8 per rank, AdamW): exact_bf16; hier (node_size alone); q8_int4
(int8 gathers + int4 gradients, no hierarchy); q8_int4_hier; q8_int8_hier. Each mode
runs alone (bytes are deterministic; no timing is reported): warm-up steps (the unit
sequence is learned), then the measured steps between two barriers.

Cross-node bytes come from stats()["comm_groups"]["inter"] (Note [Per-group byte
counters] in csrc/engine/secondary.h): of a world collective counting B bytes,
(N-L)/N crosses nodes; node-group collectives never do. The exact and q8_int4 runs
have no node groups, so the same definition is applied to their world counters here.

Loopback check: by default the benchmark re-runs itself in a private network
namespace (`unshare -n`, root only; lo brought up, gloo bound to lo), so /proc/net/dev's
`lo` counters see only these ranks' traffic. Their TX bytes minus 66 bytes of
Ethernet/IPv4/TCP headers per packet (pure ACKs are all header) are the TCP payload the
ranks sent, compared with what the counters imply gloo sends per rank: an all-gather or
all-to-all of a B-byte buffer over n ranks sends (n-1)/n*B (our gloo reduce-scatter is
an all-to-all, Note [Reduce-scatter on gloo]), a ring all-reduce 2(n-1)/n*B, a broadcast
(n-1)/n*B on average. Without a private namespace other processes on the machine share
lo and the comparison only bounds from above (said in the output). A second, per-socket
measure: the payload bytes TCP acknowledged on every socket `ss` lists (tcpi_bytes_acked:
headers and retransmissions excluded; lo's count includes retransmissions, subtracted
with ss's bytes_retrans).
Writes benchmarks/results/bench_comm_hier.json.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from machine import spawn_ranks  # noqa: E402  (benchmarks/, the script's directory)

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "bench_comm_hier.json"
HEADER_BYTES = 66   # per packet on lo: Ethernet 14 + IPv4 20 + TCP 20 + timestamps 12

BF16 = {"param_dtype": "bf16", "reduce_dtype": "bf16"}
MODES = {
    "exact_bf16": {**BF16},
    "hier": {**BF16, "node_size": "N"},
    "q8_int4": {**BF16, "param_quant": "int8", "grad_quant": "int4"},
    "q8_int4_hier": {**BF16, "param_quant": "int8", "grad_quant": "int4", "node_size": "N"},
    "q8_int8_hier": {**BF16, "param_quant": "int8", "grad_quant": "int8", "node_size": "N"},
}
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "used_flags", "broadcast")


def lo_counters():
    """(TX bytes, TX packets) of the loopback interface."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                v = rest.split()
                return int(v[8]), int(v[9])
    return 0, 0


def tcp_bytes():
    """(payload bytes acknowledged, bytes retransmitted) summed over the TCP sockets
    `ss` lists (in a private namespace: exactly these ranks' gloo connections)."""
    try:
        text = subprocess.run(["ss", "-tinH"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    acked = sum(int(v) for v in re.findall(r"bytes_acked:(\d+)", text))
    retrans = sum(int(v) for v in re.findall(r"bytes_retrans:(\d+)", text))
    return acked, retrans


def options(name, node_size):
    return {k: (node_size if v == "N" else v) for k, v in MODES[name].items()}


def snapshot(zo):
    s = zo.stats()
    return {"comm": s["comm"], "groups": s.get("comm_groups"), "peak_secondary": s["buffer_bytes"]["peak_secondary"]}


def worker(rank, world, store, out_dir, args):
    import torch.distributed as dist

    import zero_ext
    from bench_comm import gpt_and_adamw, start_rank

    data, cfg = start_rank(rank, world, store, args.n_layer, args.n_embd)
    out = {}
    for name in args.modes:
        zm, zo = zero_ext.zeroify(*gpt_and_adamw(cfg), stage=3, quant_block_numel=args.block,
                                  unit_modules=["Block"], **options(name, args.node_size))

        def step(k):
            x, y = data.get_batch("train", 8, 64, torch.Generator().manual_seed(1000 * rank + k))
            _, loss = zm(x, y)
            loss.backward()
            zo.step()
            zo.zero_grad()

        for k in range(args.warmup):
            step(k)
        dist.barrier()
        time.sleep(0.5)                      # let the barrier's ACKs drain
        before, lo0, tcp0 = snapshot(zo), lo_counters(), tcp_bytes() if rank == 0 else None
        for k in range(args.steps):
            step(args.warmup + k)
        dist.barrier()
        time.sleep(0.5)
        after, lo1, tcp1 = snapshot(zo), lo_counters(), tcp_bytes() if rank == 0 else None
        out[name] = {"before": before, "after": after, "lo_bytes": lo1[0] - lo0[0], "lo_packets": lo1[1] - lo0[1],
                     "tcp_acked": tcp1[0] - tcp0[0] if tcp0 and tcp1 else None,
                     "tcp_retrans": tcp1[1] - tcp0[1] if tcp0 and tcp1 else None,
                     "num_params": zo.stats()["num_params"]}
        del zm, zo
        dist.barrier()
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def delta(a, b, key):
    return b[key] - a[key]


def cross_node(m, world, node, steps):
    """Per step, per kind: (logical, wire) bytes one rank exchanges across nodes."""
    b, a = m["before"], m["after"]
    out = {}
    for kind in KINDS:
        if a["groups"] is not None:
            ia, ib = a["groups"]["inter"][kind], b["groups"]["inter"][kind]
            out[kind] = (delta(ib, ia, "bytes") / steps, delta(ib, ia, "wire_bytes") / steps)
        else:   # no node groups: the same definition on the world counters
            ca, cb = a["comm"][kind], b["comm"][kind]
            out[kind] = (delta(cb, ca, "bytes") * (world - node) / world / steps,
                         delta(cb, ca, "wire_bytes") * (world - node) / world / steps)
    return out


def node_gather(m):
    if m["after"]["groups"] is None:
        return {"bytes": 0, "wire_bytes": 0}
    a, b = m["after"]["groups"]["intra"]["node_all_gather"], m["before"]["groups"]["intra"]["node_all_gather"]
    return {k: delta(b, a, k) for k in ("bytes", "wire_bytes")}


def gloo_sent(m, world, node):
    """Bytes this rank's collectives send on gloo over the measured steps."""
    b, a = m["before"]["comm"], m["after"]["comm"]
    w = {k: delta(b[k], a[k], "wire_bytes") for k in KINDS}
    frac = (world - 1) / world
    sent = frac * (w["all_gather"] + w["reduce_scatter"] + w["broadcast"]) + 2 * frac * (w["all_reduce"] + w["used_flags"])
    sent += (node - 1) / node * node_gather(m)["wire_bytes"]
    return sent


def in_private_netns(argv):
    """Re-run this script in a private network namespace; None when that is impossible."""
    if os.environ.get("ZX_BENCH_NETNS") or not shutil.which("unshare") or not shutil.which("ip") or os.geteuid() != 0:
        return None
    cmd = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", sys.executable, *argv]
    env = {**os.environ, "ZX_BENCH_NETNS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    try:
        return subprocess.call(cmd, env=env)
    except OSError:
        return None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--node-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6, help="measured steps per mode")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--block", type=int, default=256, help="quant_block_numel")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--no-netns", action="store_true", help="measure on the shared loopback")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if not args.no_netns and not os.environ.get("ZX_BENCH_NETNS"):
        rc = in_private_netns([str(Path(__file__).resolve()), *sys.argv[1:]])
        if rc is not None:
            sys.exit(rc)
        print("no private network namespace (needs root and unshare): measuring on the shared loopback")
    private = bool(os.environ.get("ZX_BENCH_NETNS"))
    if "exact_bf16" not in args.modes:
        args.modes = ["exact_bf16"] + args.modes
    world, node = args.world, args.node_size
    t0 = time.time()
    ranks = spawn_ranks(worker, world, args)
    r0 = ranks[0]
    exact = cross_node(r0["exact_bf16"], world, node, args.steps)
    exact_wire = sum(w for _, w in exact.values())
    rows, summary = [], {}
    for name in args.modes:
        m = r0[name]
        x = cross_node(m, world, node, args.steps)
        wire = sum(w for _, w in x.values())
        logical = sum(lg for lg, _ in x.values())
        expected = sum(gloo_sent(r[name], world, node) for r in ranks)
        lo_payload = m["lo_bytes"] - HEADER_BYTES * m["lo_packets"] - (m["tcp_retrans"] or 0)
        acked = m["tcp_acked"]
        summary[name] = {
            "options": options(name, node),
            "inter_bytes_per_step": {k: {"bytes": v[0], "wire_bytes": v[1]} for k, v in x.items()},
            "inter_wire_bytes_per_step": wire, "inter_logical_bytes_per_step": logical,
            "inter_wire_vs_exact_bf16": wire / exact_wire,
            "node_all_gather_bytes_per_step": node_gather(m)["bytes"] / args.steps,
            "peak_secondary_bytes": m["after"]["peak_secondary"],
            "loopback": {"tx_bytes": m["lo_bytes"], "tx_packets": m["lo_packets"], "payload_bytes": lo_payload,
                         "tcp_retrans_bytes": m["tcp_retrans"], "tcp_acked_bytes": acked,
                         "counters_gloo_bytes": expected,
                         "payload_vs_counters": lo_payload / expected - 1.0 if expected else None,
                         "acked_vs_counters": acked / expected - 1.0 if expected and acked is not None else None},
        }
        rows.append([name, f"{x['all_gather'][1] / 1024:.1f}", f"{x['reduce_scatter'][1] / 1024:.1f}",
                     f"{(x['all_reduce'][1] + x['used_flags'][1] + x['broadcast'][1]) / 1024:.2f}",
                     f"{wire / 1024:.1f}", f"{logical / 1024:.1f}", f"{wire / exact_wire:.3f}",
                     f"{node_gather(m)['bytes'] / args.steps / 1024:.1f}",
                     f"{m['after']['peak_secondary'] / 1024:.0f}",
                     f"{expected / 1024:.0f}", f"{lo_payload / 1024:.0f}",
                     f"{100 * summary[name]['loopback']['payload_vs_counters']:+.2f}%",
                     "-" if acked is None else f"{100 * summary[name]['loopback']['acked_vs_counters']:+.2f}%"])
    head = ["mode", "AG inter KiB/step", "RS inter", "other inter", "inter wire total", "inter logical",
            "inter / exact_bf16", "node AG KiB/step", "peak secondary KiB",
            "counters: gloo KiB sent", "lo payload KiB", "lo vs counters", "TCP acked vs counters"]
    widths = [max(len(str(v)) for v in col) for col in zip(head, *rows)]
    for row in [head] + rows:
        print("  ".join(str(v).rjust(w) for v, w in zip(row, widths)))
    print(f"world {world} as {world // node} nodes of {node}, stage 3, {args.steps} measured steps per mode "
          f"(+{args.warmup} warm-up), block {args.block}, {r0['exact_bf16']['num_params']} parameters, "
          f"torch {torch.__version__}, {time.time() - t0:.0f} s")
    print("loopback: " + ("private network namespace: only these ranks' traffic" if private else
                          "SHARED with every process on this machine: other traffic inflates lo counts"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"world": world, "node_size": node, "stage": 3, "steps": args.steps,
                                    "warmup": args.warmup, "block": args.block, "n_layer": args.n_layer, "n_embd": args.n_embd,
                                    "torch": torch.__version__, "private_loopback": private,
                                    "header_bytes_per_packet": HEADER_BYTES,
                                    "command": "python benchmarks/bench_comm_hier.py " + " ".join(sys.argv[1:]),
                                    "modes": summary}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
