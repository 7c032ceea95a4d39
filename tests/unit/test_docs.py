"""The product's docs speak of the product, and the walkthroughs match what they claim."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from client.cli._common import add_model_options

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted((REPO / "docs").rglob("*.md"))
# Words of how the product was made, not of the product: a reader has no issue tracker,
# sessions or device leases, and no sibling folder of this repository.
PROCESS_WORDS = re.compile(
    r"\bissues?\s+\d+|\bthe issue\b|\bsessions?\b|\bleases?\b|follow-up|\.\./shared|shared/design"
    # ... nor words to whoever maintains the docs instead of to the reader using the product
    r"|what was run here|paste (?:its|the) json|no cuda run (?:is recorded )?yet|not run here",
    re.IGNORECASE,
)


# Every file of the product (code, tests, scripts, docker, README) and the notes it was built
# from: a reader of the repository has no sibling folder to follow.
BUILD_NOTES = re.compile(r"\.\./shared|shared/(?:design|notes|style)")
TEXT_SUFFIXES = {".py", ".md", ".toml", ".yaml", ".yml", ".sh", ".txt", ".cfg", ".json", ""}


def _product_files() -> list[Path]:
    skipped = {".git", ".venv", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"}
    return [
        path
        for path in REPO.rglob("*")
        if path.is_file()
        and not skipped.intersection(path.relative_to(REPO).parts)
        and path.suffix in TEXT_SUFFIXES | {".Dockerfile", ".dockerignore"}
        and path != Path(__file__).resolve()
    ]


def test_no_file_of_the_product_points_to_the_notes_it_was_built_from():
    found = [
        f"{path.relative_to(REPO)}:{number}"
        for path in _product_files()
        for number, line in enumerate(
            path.read_text(encoding="utf-8", errors="replace").splitlines(), 1
        )
        if BUILD_NOTES.search(line)
    ]
    assert found == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: str(path.relative_to(REPO)))
def test_no_doc_speaks_of_how_it_was_made(doc):
    found = [
        f"{doc.name}:{number}: {line.strip()[:80]}"
        for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1)
        if PROCESS_WORDS.search(line)
    ]
    assert found == []


def test_gpu_doc_names_every_model_option_and_how_to_get_a_checkpoint():
    # Arrange
    parser = argparse.ArgumentParser(add_help=False)
    add_model_options(parser)
    flags = [f for action in parser._actions for f in action.option_strings if f.startswith("--")]
    text = (REPO / "docs" / "gpu.md").read_text(encoding="utf-8")

    # Assert: every flag is documented, none is said to be missing, and the install has pytest
    assert [flag for flag in flags if f"`{flag}`" not in text] == []
    assert "do not expose" not in text
    assert "hf download" in text
    assert "--local-dir" in text
    assert "--group dev" in text
    assert "scripts/model_memory.py" in text


def test_deployment_walkthrough_starts_services_with_the_idle_limit_its_text_times():
    # Arrange
    text = " ".join((REPO / "docs" / "deployment.md").read_text(encoding="utf-8").split())
    loop = text[text.index("## 6. Each site's service") : text.index("## 7.")]
    idle = re.search(r"--idle-release-seconds (\d+)", loop)
    stage = re.search(r"stage-timeout=([\d.]+)", text)

    # Assert: the services get a limit, above the run's stage timeout, and the text times it
    assert idle is not None
    assert stage is not None
    limit = int(idle.group(1))
    assert limit > float(stage.group(1))
    assert f"`--idle-release-seconds {limit}`" in text
    assert f"{limit} to {limit + 30} s later" in text


def test_readme_names_the_pretrained_model_where_the_assembly_script_puts_it(tmp_path):
    # Arrange: every shell argument of the README that names the assembled model
    import subprocess

    from client.models.pretrained import default_pretrained_model_dir

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.DOTALL)
    commands = [re.sub(r"(^|\s)#.*", "", line) for b in blocks for line in b.splitlines()]
    named = [
        word
        for line in commands
        for word in re.findall(r'"[^"]*shapes-smollm2"|\S*shapes-smollm2\S*', line)
    ]
    cache = tmp_path / "cache"
    # Act: what the shell makes of each, with XDG_CACHE_HOME set
    expanded = [
        subprocess.run(
            ["bash", "-c", f"printf %s {word}"],
            env={"HOME": str(tmp_path / "home"), "XDG_CACHE_HOME": str(cache)},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for word in named
    ]
    # Assert: the folder the assembly script writes under that cache
    assert named
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(cache))
        assert set(expanded) == {str(default_pretrained_model_dir())}


def test_the_design_s_room_map_names_every_room_of_the_code():
    # Arrange: the map is the first code block under "## Rooms"
    text = (REPO / "docs" / "design.md").read_text(encoding="utf-8")
    rooms_section = text[text.index("## Rooms") :]
    block = rooms_section.split("```")[1]
    mapped = set(re.findall(r"^[ ]+(\w+)/", block, re.MULTILINE))
    packages = {
        path.parent.name
        for top in ("client", "server", "dpmtv_common")
        for path in (REPO / top).glob("*/__init__.py")
    }
    # Assert: every package one level down is on the map, and the map names no other
    assert packages - mapped == set()
    assert mapped - packages == set()
