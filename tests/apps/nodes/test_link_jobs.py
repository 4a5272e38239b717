"""Link measurement is a job row, like a pull: claimed with a lease, its progress counted in
node pairs, ended in a final state whatever its task raises; measured here between fake
agents (tests/fakes/agent.py), over real sockets."""

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.nodes import services
from apps.nodes.models import LinkJob, NodeLink
from apps.nodes.services import record_heartbeat
from controlplane.jobs import LOST
from tests.fakes.agent import FakeAgent


@pytest.fixture
def second_agent(db):
    fake = FakeAgent("fake-b")
    fake.node = record_heartbeat(fake.payload())
    yield fake
    fake.close()


def test_a_link_job_measures_every_pair_and_ends_done(fake_agent, second_agent):
    fake_agent.unreachable = {second_agent.address}
    job = services.start_link_job()
    assert job.state == LinkJob.State.PENDING
    job = services.run_link_job(job.pk)
    assert job.state == LinkJob.State.DONE and job.error == ""
    assert (job.pairs_done, job.pairs_total, job.progress) == (2, 2, 1.0)
    assert job.lease_expires_at > job.started_at and job.finished_at is not None
    a_to_b = NodeLink.objects.get(source=fake_agent.node, target=second_agent.node)
    b_to_a = NodeLink.objects.get(source=second_agent.node, target=fake_agent.node)
    assert a_to_b.rtt_ms is None and "did not answer" in a_to_b.error  # measured: a failure
    assert b_to_a.rtt_ms == 0.4 and b_to_a.mbit_s == 940.0 and b_to_a.error == ""
    again = services.run_link_job(job.pk)  # a second delivery finds its claim taken
    assert again.state == LinkJob.State.DONE
    assert len(fake_agent.calls_of("MeasureLink")) == 1


def test_a_link_job_fails_with_the_reason_whatever_its_task_raises(
    fake_agent, second_agent, monkeypatch
):
    def broken(*args, **kwargs):
        raise RuntimeError("the database went away")

    monkeypatch.setattr(services, "_measure_pair", broken)
    job = services.run_link_job(services.start_link_job().pk)
    assert job.state == LinkJob.State.FAILED
    assert "RuntimeError: the database went away" in job.error


def test_the_sweeper_fails_lost_link_jobs_and_resends_forgotten_ones(db, monkeypatch):
    from apps.nodes import tasks

    sent = []
    monkeypatch.setattr(tasks.measure_links, "delay", lambda pk: sent.append(pk))
    past = timezone.now() - timedelta(minutes=10)
    lost = LinkJob.objects.create(state=LinkJob.State.RUNNING, lease_expires_at=past)
    running = LinkJob.objects.create(
        state=LinkJob.State.RUNNING, lease_expires_at=timezone.now() + timedelta(minutes=5)
    )
    forgotten = LinkJob.objects.create()
    LinkJob.objects.filter(pk=forgotten.pk).update(created_at=past)
    fresh = LinkJob.objects.create()
    result = tasks.expire_link_job_leases()
    assert result == {"lost": [lost.pk], "resent": [forgotten.pk]} and sent == [forgotten.pk]
    lost.refresh_from_db()
    assert lost.state == LinkJob.State.FAILED and lost.error == LOST and lost.finished_at
    for job in (running, fresh):
        state = job.state
        job.refresh_from_db()
        assert job.state == state  # untouched
