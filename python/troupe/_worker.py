"""A Python worker process: hosts one Python actor for a node agent.

Started as `python3 -m troupe._worker` with the same flags as troupe-worker. The actor's class,
arguments and keyword arguments arrive (cloudpickled) in --args-file.
"""
import argparse
import os
import sys
import traceback


def main():
    from troupe import _core, _serialization

    _core.die_with_parent()  # never outlive the node agent
    parser = argparse.ArgumentParser(prog="troupe._worker")
    parser.add_argument("--actor-id", required=True)
    parser.add_argument("--type", required=True)
    parser.add_argument("--incarnation", type=int, required=True)
    parser.add_argument("--controller", required=True)
    parser.add_argument("--node-ip-address", default="127.0.0.1")
    parser.add_argument("--args-file", required=True)
    parser.add_argument("--parent-pid", type=int, default=0)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args()
    if args.parent_pid and os.getppid() != args.parent_pid:
        return 1  # the node agent died before die_with_parent took effect
    with open(args.args_file, "rb") as f:
        init = f.read()
    os.unlink(args.args_file)
    cls, cargs, ckwargs = _serialization.loads(init)
    os.environ["TROUPE_ACTOR_ID"] = args.actor_id
    os.environ["TROUPE_ADDRESS"] = args.controller  # troupe.init() in a process it starts (a job's driver)
    try:
        instance = cls(*cargs, **ckwargs)
    except BaseException:
        print(f"troupe-worker: {cls.__name__}.__init__ raised:", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        return 1

    # Node agents start workers with PYTHONUNBUFFERED=1, so output reaches the log files as it is
    # written; flushing after every call would only cost time (two calls per actor call).
    buffered = not os.environ.get("PYTHONUNBUFFERED")

    def dispatch(method, payload):
        try:
            call_args, call_kwargs = _serialization.loads(payload)
            result = getattr(instance, method)(*call_args, **call_kwargs)
            return _serialization.dump_reply(result)
        except BaseException as exc:  # the caller re-raises it
            return _serialization.dump_exception(exc, traceback.format_exc())
        finally:
            if buffered:
                sys.stdout.flush()
                sys.stderr.flush()

    _core.serve_actor(args.actor_id, args.incarnation, args.controller, args.node_ip_address,
                      os.environ["TROUPE_TOKEN"], dispatch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
