"""Start-up cost of the recipe scripts: ``--help`` and an argument error, against ``import torch``.

    python -m bench startup            # 3 repeats, median
    python -m bench startup --repeats 5

Every command runs in a fresh interpreter. Reported: wall time and CPU time (user + system of the
child, from ``getrusage(RUSAGE_CHILDREN)``: less sensitive to a busy machine than the wall clock),
and each command's CPU time over that of ``python -c "import torch"`` measured in the same run.
The target is ``--help`` and argument errors under 1.5 s of wall time on an idle machine,
which needs them to answer before torch is imported (ratio well below 1).
"""
import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = ("hyp_vit", "hyp_mix", "hyp_uml_cars", "unsupervised_hyperbolic", "hcl", "hier")


def measure(cmd, repeats):
    """Median (wall seconds, CPU seconds) of ``cmd`` and its exit status."""
    walls, cpus, status = [], [], None
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        walls.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime))
        status = proc.returncode
    return statistics.median(walls), statistics.median(cpus), status


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="Runs of each command (the median is shown).")
    args = parser.parse_args(argv)
    py = sys.executable
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}  ({os.cpu_count()} CPUs)")
    base_wall, base_cpu, _ = measure([py, "-c", "import torch"], args.repeats)
    print(f"{'command':<52} {'wall s':>7} {'CPU s':>7} {'CPU / import torch':>19}  exit")
    baseline = 'python -c "import torch"'
    print(f"{baseline:<52} {base_wall:7.2f} {base_cpu:7.2f} {1.0:19.2f}")
    rows = [{"command": baseline, "wall s": round(base_wall, 3), "CPU s": round(base_cpu, 3), "CPU ratio": 1.0,
             "exit": 0, "baseline": baseline}]
    worst = 0.0
    for recipe in RECIPES:
        script = os.path.join("recipes", f"{recipe}.py")
        for label, extra in (("--help", ["--help"]), ("--dataset foo", ["--dataset", "foo"])):
            wall, cpu, status = measure([py, script, *extra], args.repeats)
            worst = max(worst, wall)
            print(f"{f'{recipe}.py {label}':<52} {wall:7.2f} {cpu:7.2f} {cpu / base_cpu:19.2f}  {status}")
            rows.append({"command": f"{recipe}.py {label}", "wall s": round(wall, 3), "CPU s": round(cpu, 3),
                         "CPU ratio": round(cpu / base_cpu, 3), "exit": status, "baseline": baseline})
    print(f"slowest: {worst:.2f} s wall (target < 1.5 s idle); load average after: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return rows


if __name__ == "__main__":
    main()
