"""`manage.py deploy MODEL [--split-mode M] [--swa-cache window|full] [--pin NODE ...] [--plan]
[--wait SECONDS]`:
deploy a model (or reuse its deployment); --plan prints the plan and deploys nothing."""

import time

from django.core.management.base import BaseCommand, CommandError

from apps.deployments import services
from apps.deployments.models import Deployment
from controlplane.errors import DomainError

D = Deployment.State


class Command(BaseCommand):
    help = "Create a deployment of a catalog model and optionally wait until it is ready."

    def add_arguments(self, parser):
        parser.add_argument("model")
        parser.add_argument("--name", default="", help="deployment name (default: the model's)")
        parser.add_argument("--replicas", type=int, default=1)
        parser.add_argument("--context-length", type=int, default=None)
        parser.add_argument("--parallel", type=int, default=None)
        parser.add_argument("--wait", type=float, default=0, help="seconds to wait for ready")
        parser.add_argument("--split-mode", default="auto", choices=Deployment.SplitMode.values)
        parser.add_argument(
            "--swa-cache",
            default=Deployment.SwaCache.WINDOW,
            choices=Deployment.SwaCache.values,
            help="sliding-window models: window (less KV) or full (any shared prefix reusable)",
        )
        parser.add_argument("--pin", nargs="*", default=[], help="only these nodes, head first")
        parser.add_argument("--plan", action="store_true", help="print the plan; deploy nothing")

    def handle(self, model, name, replicas, context_length, parallel, wait, **options):
        name = name or model
        mode, pins = options["split_mode"], options["pin"]
        swa_cache = options["swa_cache"]
        if options["plan"]:
            return self._plan(model, replicas, context_length, parallel, mode, pins, swa_cache)
        d = Deployment.objects.filter(name=name).first()
        try:
            if d is None:
                d = services.do_create(
                    name, model, replicas, context_length, parallel,
                    split_mode=mode, pin_nodes=pins, swa_cache=swa_cache,
                )  # fmt: skip
                self.stdout.write(f"deployment {name} created")
            elif d.state in (D.FAILED, D.CRASH_LOOP, D.STOPPED):
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
            if d.state in (D.FAILED, D.CRASH_LOOP):  # restarts go on in the background
                raise CommandError(f"deployment {name} is {d.state}: {d.error}")
            time.sleep(0.5)
        if wait and d.state != Deployment.State.READY:
            raise CommandError(f"deployment {name} is {d.state} after {wait:.0f} s: {d.error}")
        self.stdout.write(f"deployment {name} is {d.state}")

    def _plan(self, model, replicas, context_length, parallel, mode, pins, swa_cache):
        from apps.deployments import placement

        try:
            m, context_length, parallel = services.check_create(
                "", model, replicas, context_length, parallel, mode, pins
            )
        except DomainError as exc:
            raise CommandError(exc.message) from exc
        plan = placement.preview(
            m, context_length, parallel, replicas, mode, pins, swa_cache=swa_cache
        )
        self.stdout.write(
            f"{plan.kind}" + (f" ({plan.split_mode})" if plan.kind == "split" else "")
        )
        for s in plan.stages:
            layers = f"layers {s.layer_start}-{s.layer_end - 1}" if s.layers else "no layers"
            self.stdout.write(
                f"  {s.role:7} {s.node:20} {layers:16} {s.total_bytes / 2**30:6.2f} GiB"
                + (f"  n_gpu_layers {s.n_gpu_layers}" if s.n_gpu_layers else "")
            )
        for line in plan.reasons:
            self.stdout.write(f"  because {line}")
        for line in plan.warnings:
            self.stdout.write(f"  warning: {line}")
        if plan.error:
            raise CommandError(plan.error)
