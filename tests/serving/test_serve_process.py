"""`cpuserve serve` as a process: what it leaves behind when it stops."""

from __future__ import annotations

import os
import subprocess
import sys

from cpuserve.serving.app import remove_openmp_registrations


def test_openmp_registrations_of_dead_processes_are_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    uid = os.getuid()
    files = {name: tmp_path / f"__KMP_REGISTERED_LIB_{pid}_{u}"
             for name, pid, u in (("dead", dead.pid, uid), ("alive", os.getpid(), uid), ("other", dead.pid, uid + 1))}
    for path in files.values():
        path.write_text("registration")
    assert remove_openmp_registrations({dead.pid, os.getpid()}, shm=tmp_path) == [files["dead"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(files[k].name for k in ("alive", "other"))
