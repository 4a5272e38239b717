"""`manage.py pull_model NAME [--path FILE]`: pull a known model or import a local GGUF;
`manage.py pull_model hf://org/repo:Q4_K_M [--name NAME]`: pull from Hugging Face."""

from django.core.management.base import BaseCommand, CommandError

from apps.catalog import services, sources
from apps.catalog.management.progress import printer
from apps.catalog.models import CatalogModel, PullJob
from controlplane.errors import DomainError


class Command(BaseCommand):
    help = (
        f"Pull a model into the store (known: {', '.join(sorted(sources.KNOWN_MODELS))}), "
        "import a local GGUF file with --path, or pull hf://org/repo[:TAG|/FILE.gguf]."
    )

    def add_arguments(self, parser):
        parser.add_argument("name", help="a known model's name, or an hf:// name")
        parser.add_argument("--name", dest="as_name", default="", help="catalog name (hf://)")
        parser.add_argument("--path", default="", help="import this local GGUF file under NAME")
        parser.add_argument("--if-missing", action="store_true", help="do nothing if NAME is ready")

    def handle(self, name, path, if_missing, as_name="", **options):
        source = ""
        if name.startswith("hf://"):
            source, name = name, as_name
        if if_missing and CatalogModel.objects.filter(name=name, state="ready").exists():
            model = CatalogModel.objects.get(name=name)
            if model.path.exists():
                self.stdout.write(f"{name} is ready ({model.sha256[:12]})")
                return
        try:
            job = services.create_pull(name, path, source)
        except DomainError as exc:
            raise CommandError(exc.message) from exc
        # Run in this process, printing the job's progress as it moves.
        job = services.run_pull(job.pk, on_progress=printer(self.stderr))
        if job.state != PullJob.State.DONE:
            raise CommandError(f"pull of {name or source} failed: {job.error}")
        model = job.model
        model.refresh_from_db()
        self.stdout.write(
            f"{model.name} is ready: {model.architecture}, "
            f"{model.parameters / 1e6:.0f}M parameters, {model.quantization}, "
            f"{model.n_layers} layers, {model.size_bytes / 1e6:.0f} MB, "
            f"sha256 {model.sha256[:12]}"
        )
