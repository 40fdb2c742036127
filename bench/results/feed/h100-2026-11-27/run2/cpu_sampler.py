"""Every INTERVAL s: CPU% per process (train replica, workers) and per thread of the busiest python process."""
import os, sys, time
TICK = os.sysconf("SC_CLK_TCK")
def stat(path):
    try:
        with open(path) as f: d = f.read()
    except OSError: return None
    name = d[d.index("(")+1:d.rindex(")")]
    rest = d.rsplit(")", 1)[1].split()
    return name, (int(rest[11]) + int(rest[12])) / TICK
def snapshot():
    procs = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit(): continue
        s = stat(f"/proc/{pid}/stat")
        if s is None: continue
        try: cmd = open(f"/proc/{pid}/cmdline","rb").read().replace(b"\0", b" ").decode()[:80]
        except OSError: cmd = ""
        if "python" in cmd or s[0].startswith("pt_"):
            threads = {}
            try:
                for tid in os.listdir(f"/proc/{pid}/task"):
                    t = stat(f"/proc/{pid}/task/{tid}/stat")
                    if t: threads[tid] = t
            except OSError: pass
            procs[pid] = (s[0], cmd, s[1], threads)
    return procs
interval = float(sys.argv[1]) if len(sys.argv) > 1 else 5
prev, t0 = snapshot(), time.time()
while True:
    time.sleep(interval)
    cur, t1 = snapshot(), time.time(); dt = t1 - t0
    rows = []
    for pid, (name, cmd, cpu, threads) in cur.items():
        if pid in prev:
            rows.append(((cpu - prev[pid][2]) / dt, pid, name, cmd, threads, prev[pid][3]))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    print(f"== {time.strftime('%T')} python+workers {100*total:.0f}% of a core; busiest:", flush=True)
    workers = [r for r in rows if r[2].startswith("pt_")]
    if workers:
        print(f"   {len(workers)} workers: mean {100*sum(r[0] for r in workers)/len(workers):.0f}%, min {100*min(r[0] for r in workers):.0f}%, max {100*max(r[0] for r in workers):.0f}%")
    for share, pid, name, cmd, threads, pthreads in rows[:3]:
        if name.startswith("pt_"): continue
        print(f"   {pid} {name} {100*share:.0f}% {cmd}")
        tl = sorted(((c - pthreads[t][1]) / dt, t, n) for t, (n, c) in threads.items() if t in pthreads)[::-1][:6]
        print("      threads: " + ", ".join(f"{n}:{100*s:.0f}%" for s, t, n in tl))
    prev, t0 = cur, t1
