"""
A downstream project's tests of its own code that asks the host PID broker,
written the way such a project would write them: no root, no real broker, no
read-only mount, just C{hostpid.testing.FakeBroker}.

The suite runs this module as a real UID 1000 process under both
C{python -m twisted.trial} and C{python -m pytest}
(C{tests/test_testing.py}); it is not collected with the main suite.
"""

from __future__ import annotations

import os

from twisted.internet import reactor, threads
from twisted.internet.defer import Deferred
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase

import hostpid
from hostpid.testing import Close, Delay, FakeBroker, Reply, Silent


def describe_pid(policy: hostpid.TrustPolicy, environ: dict[str, str]) -> str:
    """The downstream code under test: the blocking client, with a fallback."""
    pid = hostpid.lookup_host_pid(policy, environ)
    return "fallback" if pid is None else f"host pid {pid}"


def describe_pid_deferred(policy: hostpid.TrustPolicy, environ: dict[str, str]) -> Deferred[str]:
    """The same for Twisted code: the Twisted client."""
    d = hostpid.query_host_pid_deferred(policy, environ)
    d.addCallbacks(lambda pid: f"host pid {pid}", lambda _: "fallback")
    return d


class BlockingClientTests(TestCase):
    def setUp(self) -> None:
        self.environ = {"LIBVGPU_HOSTPID_BROKER": "1"}

    def test_own_pid(self) -> None:
        with FakeBroker() as broker:
            self.assertEqual(describe_pid(broker.policy, self.environ), f"host pid {os.getpid()}")
            self.assertEqual(broker.requests, [b"HPID\x00\x01\x00\x01"])

    def test_fixed_pid(self) -> None:
        with FakeBroker(pid=4242) as broker:
            self.assertEqual(describe_pid(broker.policy, self.environ), "host pid 4242")

    def test_refusing_broker(self) -> None:
        with FakeBroker(reply=b"HPID\x00\x01\x00\x01\x00\x00\x00\x00") as broker:
            self.assertEqual(describe_pid(broker.policy, self.environ), "fallback")
            with self.assertRaises(hostpid.HostPidUnavailable) as caught:
                hostpid.query_host_pid(broker.policy, self.environ)
            self.assertEqual(caught.exception.check, "reply")

    def test_silent_broker(self) -> None:
        with FakeBroker(silent=True, deadline=0.2) as broker:
            with self.assertRaises(hostpid.HostPidUnavailable) as caught:
                hostpid.query_host_pid(broker.policy, self.environ)
            self.assertEqual(caught.exception.check, "deadline")

    def test_a_script_of_brokers(self) -> None:
        """A slow broker, one that hangs up, one that never answers, then a good one."""
        script = [Delay(0.1, then=Reply(pid=41)), Close(), Silent(), Reply(pid=42)]
        with FakeBroker(script=script, deadline=0.3) as broker:
            answers = [describe_pid(broker.policy, self.environ) for _ in range(4)]
            self.assertEqual(answers, ["host pid 41", "fallback", "fallback", "host pid 42"])
            self.assertEqual((broker.remaining, broker.unscripted), ((), 0))

    def test_a_broker_restart(self) -> None:
        with FakeBroker(script=[Reply(pid=43), Reply(pid=44)]) as broker:
            self.assertEqual(describe_pid(broker.policy, self.environ), "host pid 43")
            broker.restart()
            self.assertEqual(describe_pid(broker.policy, self.environ), "host pid 44")

    def test_gate_off(self) -> None:
        with FakeBroker() as broker:
            self.assertEqual(describe_pid(broker.policy, {}), "fallback")
            self.assertEqual(broker.connections, 0)

    def test_while_the_reactor_runs(self) -> Deferred[None]:
        """Called from a reactor callback: the fake does not need the reactor."""
        broker = FakeBroker().start()
        self.addCleanup(broker.stop)

        def in_the_reactor() -> str:
            self.assertTrue(reactor.running)  # type: ignore[attr-defined]
            return describe_pid(broker.policy, self.environ)

        d = deferLater(reactor, 0, in_the_reactor)
        d.addCallback(self.assertEqual, f"host pid {os.getpid()}")
        return d

    def test_from_a_thread(self) -> Deferred[None]:
        broker = FakeBroker().start()
        self.addCleanup(broker.stop)
        d = threads.deferToThread(describe_pid, broker.policy, self.environ)
        d.addCallback(self.assertEqual, f"host pid {os.getpid()}")
        return d


class TwistedClientTests(TestCase):
    def setUp(self) -> None:
        self.environ = {"LIBVGPU_HOSTPID_BROKER": "1"}
        self.broker = FakeBroker().start()
        self.addCleanup(self.broker.stop)

    def test_own_pid(self) -> Deferred[None]:
        d = describe_pid_deferred(self.broker.policy, self.environ)
        d.addCallback(self.assertEqual, f"host pid {os.getpid()}")
        return d

    async def test_fixed_pid(self) -> None:
        with FakeBroker(pid=7) as broker:
            pid = await hostpid.query_host_pid_deferred(broker.policy, self.environ)
        self.assertEqual(pid, 7)

    async def test_silent_broker(self) -> None:
        with FakeBroker(silent=True, deadline=0.2) as broker:
            with self.assertRaises(hostpid.HostPidUnavailable) as caught:
                await hostpid.query_host_pid_deferred(broker.policy, self.environ)
        self.assertEqual(caught.exception.check, "deadline")

    async def test_a_script_and_a_restart(self) -> None:
        script = [Delay(0.1, then=Reply(pid=45)), Close(), Reply(pid=46)]
        with FakeBroker(script=script) as broker:
            first = await describe_pid_deferred(broker.policy, self.environ)
            second = await describe_pid_deferred(broker.policy, self.environ)
            broker.restart()
            third = await describe_pid_deferred(broker.policy, self.environ)
        self.assertEqual([first, second, third], ["host pid 45", "fallback", "host pid 46"])
