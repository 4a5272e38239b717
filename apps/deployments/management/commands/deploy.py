"""`manage.py deploy MODEL [--wait SECONDS]`: deploy a model (or reuse its deployment)."""

import time

from django.core.management.base import BaseCommand, CommandError

from apps.deployments import services
from apps.deployments.models import Deployment
from controlplane.errors import DomainError


class Command(BaseCommand):
    help = "Create a deployment of a catalog model and optionally wait until it is ready."

    def add_arguments(self, parser):
        parser.add_argument("model")
        parser.add_argument("--name", default="", help="deployment name (default: the model's)")
        parser.add_argument("--replicas", type=int, default=1)
        parser.add_argument("--context-length", type=int, default=None)
        parser.add_argument("--parallel", type=int, default=None)
        parser.add_argument("--wait", type=float, default=0, help="seconds to wait for ready")

    def handle(self, model, name, replicas, context_length, parallel, wait, **options):
        name = name or model
        d = Deployment.objects.filter(name=name).first()
        try:
            if d is None:
                d = services.do_create(name, model, replicas, context_length, parallel)
                self.stdout.write(f"deployment {name} created")
            elif d.state in (Deployment.State.FAILED, Deployment.State.STOPPED):
                d = services.do_redeploy(d)
                self.stdout.write(f"deployment {name} redeployed")
        except DomainError as exc:
            raise CommandError(exc.message) from exc
        deadline = time.monotonic() + wait
        last = None
        while True:
            d.refresh_from_db()
            if d.state != last:
                self.stderr.write(f"  {name}: {d.state}" + (f" ({d.error})" if d.error else ""))
                last = d.state
            if d.state == Deployment.State.READY or time.monotonic() >= deadline:
                break
            if d.state == Deployment.State.FAILED:
                raise CommandError(f"deployment {name} failed: {d.error}")
            time.sleep(0.5)
        if wait and d.state != Deployment.State.READY:
            raise CommandError(f"deployment {name} is {d.state} after {wait:.0f} s: {d.error}")
        self.stdout.write(f"deployment {name} is {d.state}")
