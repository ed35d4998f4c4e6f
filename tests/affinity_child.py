"""A child for ``DaemonProcess``'s CPU test: prints the CPUs it may run on in its ready line
(``ready cpus=0-1``), then sleeps until it is terminated."""

import os
import time

from shared.cpu_affinity import format_cpu_list

if __name__ == "__main__":
    print(f"ready cpus={format_cpu_list(os.sched_getaffinity(0))}", flush=True)
    while True:
        time.sleep(60)
