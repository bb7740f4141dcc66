"""The error model end to end (issue 14): a status code crosses the RPC edge and Python raises its
class, all sharing TroupeError; nothing is recovered from message text."""
import textwrap

from troupe_testing import free_port, run_driver


def test_python_raises_the_class_of_the_runtime_status_code(troupe):
    troupe.run("start", "--head", "--port", str(free_port()), "--num-cpus", "2")
    code = textwrap.dedent("""
        import os, troupe
        from troupe import exceptions as ex
        troupe.init(address="auto")

        @troupe.remote
        class Quitter:
            def quit(self):
                os._exit(5)

        try:
            troupe.get_actor("no-such-actor")
        except ex.NotFoundError as e:
            assert isinstance(e, LookupError) and isinstance(e, ex.TroupeError) and e.code == "NOT_FOUND"
            assert not str(e).startswith("["), str(e)  # the code travels beside the message
            print("not found ok")
        q = Quitter.remote()
        try:
            troupe.get(q.quit.remote())
        except ex.ActorDiedError as e:
            assert isinstance(e, ex.TroupeError)
            print("died ok")
        # A died actor's later calls: the same class, from the code.
        try:
            troupe.get(q.quit.remote())
        except ex.ActorDiedError:
            print("died again ok")
    """)
    p = run_driver(code, env=troupe.env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "not found ok" in p.stdout and "died ok" in p.stdout
    assert "died again ok" in p.stdout


def test_init_raises_unauthenticated_for_a_wrong_token_and_unavailable_when_unreachable(troupe):
    port = free_port()
    troupe.run("start", "--head", "--port", str(port), "--num-cpus", "1")
    closed = free_port()  # nothing listens there
    code = textwrap.dedent(f"""
        import troupe
        from troupe import exceptions as ex
        try:
            troupe.init(address="127.0.0.1:{port}", token="0" * 32)
        except ex.UnauthenticatedError as e:
            # The handshake's refusal arrives by its code: a PermissionError, not a ConnectionError.
            assert isinstance(e, PermissionError) and not isinstance(e, ConnectionError), type(e).__mro__
            assert "token was rejected" in str(e) and not str(e).startswith("["), str(e)
            print("unauthenticated ok")
        try:
            troupe.init(address="127.0.0.1:{closed}", token="0" * 32)
        except ex.UnavailableError as e:
            assert isinstance(e, ConnectionError) and isinstance(e, ex.TroupeError)
            assert "cannot reach" in str(e), str(e)
            print("unavailable ok")
    """)
    p = run_driver(code, env=troupe.env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "unauthenticated ok" in p.stdout and "unavailable ok" in p.stdout, p.stdout + p.stderr
