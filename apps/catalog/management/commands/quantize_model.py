"""`manage.py quantize_model SOURCE TARGET [--name NAME]`: make a quantized variant on a node."""

from django.core.management.base import BaseCommand, CommandError

from apps.catalog import quantization
from apps.catalog.management.progress import printer
from apps.catalog.models import CatalogModel, QuantizeJob
from controlplane.errors import DomainError


class Command(BaseCommand):
    help = "Quantize a catalog model (F32/F16/BF16/Q8_0) to a target on the roomiest node."

    def add_arguments(self, parser):
        parser.add_argument("source")
        parser.add_argument("target", choices=QuantizeJob.Target.values)
        parser.add_argument("--name", default="", help="catalog name of the result")

    def handle(self, source, target, name, **options):
        model = CatalogModel.objects.filter(name=source).first()
        if model is None:
            raise CommandError(f"no model named {source}")
        try:
            job = quantization.create_quantize(model, target, name)
        except DomainError as exc:
            raise CommandError(exc.message) from exc
        job = quantization.run_quantize(job.pk, on_progress=printer(self.stderr))
        if job.state != QuantizeJob.State.DONE:
            raise CommandError(f"quantization failed: {job.error}")
        result, e = job.result, job.result.evaluation
        self.stdout.write(
            f"{result.name}: {result.quantization}, {result.size_bytes / 1e6:.0f} MB; "
            f"mean NLL {e.get('mean_nll')} (source {e.get('parent_mean_nll')}), "
            f"decode {e.get('decode_tokens_per_second')} tok/s "
            f"(source {e.get('parent_decode_tokens_per_second')})"
        )
