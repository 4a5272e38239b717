from rest_framework import serializers

from apps.catalog.models import CatalogModel, PullJob


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


class CatalogModelSerializer(serializers.ModelSerializer):
    latest_pull = serializers.SerializerMethodField()

    class Meta:
        model = CatalogModel
        exclude = []
        read_only_fields = [f.name for f in CatalogModel._meta.fields]

    def get_latest_pull(self, model) -> dict | None:
        job = model.pulls.first()
        return PullJobSerializer(job).data if job else None


class PullRequestSerializer(serializers.Serializer):
    name = serializers.SlugField(
        help_text="Catalog name; a known model, or any name with local_path."
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
