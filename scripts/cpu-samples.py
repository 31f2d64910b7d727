#!/usr/bin/env python3
"""CPU of the test control plane and the fleet benchmark's processes, sampled every 100 ms.

    python3 scripts/cpu-samples.py record FILE SECONDS   # while a benchmark runs
    python3 scripts/cpu-samples.py show FILE             # CPU % per process kind, per sample,
                                                         # while the benchmark's child lives

Reads utime + stime (clock ticks of 10 ms) from /proc/PID/stat of kube-apiserver, etcd, the
`fleet` parent and the `fleet_child` child (BENCHMARKS.md, "what bounds phase 2").
"""
import json
import os
import sys
import time

KINDS = ("kube-apiserver", "etcd", "fleet-", "fleet_child")


def kind(key):
    comm = key.split(":")[0]
    if comm.startswith("fleet_child"):
        return "child"
    if comm.startswith("fleet-"):
        return "parent"
    return comm


def record(path, seconds):
    end = time.time() + seconds
    with open(path, "w") as out:
        while time.time() < end:
            now = time.time()
            row = {}
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        stat = f.read()
                except OSError:
                    continue
                comm = stat[stat.index("(") + 1 : stat.rindex(")")]
                if comm.startswith(KINDS):
                    fields = stat[stat.rindex(")") + 2 :].split()
                    row[f"{comm}:{pid}"] = int(fields[11]) + int(fields[12])
            out.write(json.dumps([now, row]) + "\n")
            out.flush()
            time.sleep(max(0.0, 0.1 - (time.time() - now)))


def show(path):
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    alive = [t for t, r in rows if any(kind(k) == "child" for k in r)]
    if not alive:
        sys.exit("no child process in the samples")
    start = rows[0][0]
    for (t0, before), (t1, after) in zip(rows, rows[1:]):
        if not alive[0] - 0.3 <= t1 <= alive[-1] + 0.3:
            continue
        used = {}
        for key, ticks in after.items():
            if key in before:
                used[kind(key)] = used.get(kind(key), 0) + ticks - before[key]
        cells = [f"{k}={used.get(k, 0) / 100 / (t1 - t0) * 100:4.0f}%" for k in ("child", "parent", "kube-apiserver", "etcd")]
        print(f"{t1 - start:6.2f} s  " + "  ".join(cells))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "record":
        record(sys.argv[2], float(sys.argv[3]))
    elif len(sys.argv) == 3 and sys.argv[1] == "show":
        show(sys.argv[2])
    else:
        sys.exit(__doc__)
