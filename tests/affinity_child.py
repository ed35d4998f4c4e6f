"""A child for ``DaemonProcess``'s tests: says on stderr that it started, prints the CPUs it may run
on in its ready line (``ready cpus=0-1``), then sleeps until it is terminated."""

import os
import sys
import time

from shared.cpu_affinity import format_cpu_list

if __name__ == "__main__":
    cpus = format_cpu_list(os.sched_getaffinity(0))
    print(f"affinity_child: started on cpus {cpus}", file=sys.stderr, flush=True)
    print(f"ready cpus={cpus}", flush=True)
    while True:
        time.sleep(60)
