"""The processes a harness starts, and what they leave: a command tethered to its starter
(:mod:`.tether`: it ends when the harness dies, however), run under a time limit in a process
group of its own (:mod:`.bounded`), and processes found through ``/proc`` (:mod:`.pids`: a
process's descendants or group, the shared-memory files one holds) and stopped, bounded.

Standard library only.
"""
