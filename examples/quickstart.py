#!/usr/bin/env python3
"""Troupe from Python: an embedded local cluster, a Python actor, a built-in C++ actor, a crash
with its reason, a restart, and a clean shutdown. Run after `make build`:
    /usr/bin/python3 examples/quickstart.py
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", os.environ.get("BUILD", "build"),
                                "python"))
import troupe  # noqa: E402


@troupe.remote(num_cpus=1, max_restarts=1)
class Counter:
    def __init__(self, start=0):
        self.n = start

    def add(self, k=1):
        self.n += k
        print(f"counter is now {self.n}")
        return self.n

    def crash(self):
        os._exit(7)


def main():
    troupe.init(num_cpus=4)
    print("cluster resources:", troupe.cluster_resources())
    counter = Counter.remote(10)
    print("add(5) ->", troupe.get(counter.add.remote(5)))
    print("three pipelined adds ->", troupe.get([counter.add.remote() for _ in range(3)]))
    cpp = troupe.cpp_actor("Counter", init_args='{"start": 100}')  # CounterArgs, actors/schema/init_args.capnp
    print("C++ Counter add(1) ->", troupe.get(cpp.add.remote("1")))
    try:
        troupe.get(counter.crash.remote())
    except troupe.ActorDiedError as e:
        print("the actor died, and Troupe says why:", e)
    print("after the restart (state starts over) add(1) ->", troupe.get(counter.add.remote(1)))
    troupe.shutdown()


if __name__ == "__main__":
    main()
