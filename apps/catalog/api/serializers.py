from rest_framework import serializers

from apps.catalog.models import CatalogModel, ModelFile, PullJob, QuantizeJob


class PullJobSerializer(serializers.ModelSerializer):
    model = serializers.SlugRelatedField(slug_field="name", read_only=True)
    progress = serializers.FloatField(read_only=True, allow_null=True)

    class Meta:
        model = PullJob
        fields = [
            "id",
            "model",
            "state",
            "phase",
            "bytes_done",
            "bytes_total",
            "progress",
            "error",
            "local_path",
            "created_at",
            "started_at",
            "finished_at",
        ]
        read_only_fields = fields


class ModelFileSerializer(serializers.ModelSerializer):
    class Meta:
        model = ModelFile
        fields = ["index", "name", "sha256", "size_bytes"]
        read_only_fields = fields


class CatalogModelSerializer(serializers.ModelSerializer):
    latest_pull = serializers.SerializerMethodField()
    files = ModelFileSerializer(many=True, read_only=True)
    parent = serializers.SlugRelatedField(slug_field="name", read_only=True)
    variants = serializers.SlugRelatedField(slug_field="name", many=True, read_only=True)
    deployments = serializers.SerializerMethodField()

    class Meta:
        model = CatalogModel
        exclude = []
        read_only_fields = [f.name for f in CatalogModel._meta.fields]

    def get_latest_pull(self, model) -> dict | None:
        job = model.pulls.first()
        return PullJobSerializer(job).data if job else None

    def get_deployments(self, model) -> list[str]:
        """Deployments that use this model (stopped ones excluded)."""
        return [d.name for d in model.deployments.all() if d.state != d.State.STOPPED]


class QuantizeJobSerializer(serializers.ModelSerializer):
    source = serializers.SlugRelatedField(slug_field="name", read_only=True)
    result = serializers.SlugRelatedField(slug_field="name", read_only=True)
    node = serializers.SlugRelatedField(slug_field="name", read_only=True)
    progress = serializers.FloatField(read_only=True, allow_null=True)

    class Meta:
        model = QuantizeJob
        fields = [
            "id",
            "source",
            "target",
            "name",
            "node",
            "result",
            "state",
            "phase",
            "done",
            "total",
            "progress",
            "error",
            "created_at",
            "started_at",
            "finished_at",
        ]
        read_only_fields = fields


class QuantizeRequestSerializer(serializers.Serializer):
    target = serializers.ChoiceField(choices=QuantizeJob.Target.choices)
    name = serializers.SlugField(
        required=False,
        default="",
        allow_blank=True,
        help_text="Catalog name of the result (default: the source's name and the target).",
    )


class PullRequestSerializer(serializers.Serializer):
    name = serializers.SlugField(
        required=False,
        default="",
        allow_blank=True,
        help_text="Catalog name: a known model, or any name with source or local_path "
        "(with source it defaults to one made from the file's name).",
    )
    source = serializers.CharField(
        required=False,
        default="",
        allow_blank=True,
        max_length=500,
        help_text="A Hugging Face name: hf://org/repo/file.gguf, hf://org/repo:Q4_K_M or "
        "hf://org/repo, each optionally as org/repo@revision.",
    )
    local_path = serializers.CharField(
        required=False,
        default="",
        allow_blank=True,
        help_text="Import this GGUF file from the control plane's disk instead.",
    )


class KnownModelSerializer(serializers.Serializer):
    """A model that can be pulled by name."""

    name = serializers.CharField()
    description = serializers.CharField()
    source = serializers.CharField()
    sha256 = serializers.CharField()
