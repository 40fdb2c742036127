"""README.md is the landing page, docs/ the reference: the site builds with no warning, named paths exist."""

from __future__ import annotations

import inspect
import logging
import re
import shlex
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
# The guide's two commands, first and exactly so (.ci/run runs the second).
DEMO_COMMAND = "bash scripts/bootstrap.sh && .venv/bin/python scripts/demo.py"
TEST_COMMAND = "bash scripts/bootstrap.sh && .venv/bin/python -m pytest -n auto --dist loadgroup"
README_MAX_LINES = 260

# A path of this repository as the pages write it: under one of its top folders, or one
# of its top files. The lookbehind leaves out the tail of a URL or of another path
# (gs://BUCKET/tests/..., ~/tpustream/outputs/...).
REPOSITORY_PATH = re.compile(
    r"(?<![\w./:~-])"
    r"((?:src|tests|bench|conf|scripts|docs|\.ci)/[\w./<>*{}-]*"
    r"|(?:train\.py|pyproject\.toml|Dockerfile|mkdocs\.yml|README\.md)\b)"
)
# A code span that is a module path relative to the package, as the pages name modules:
# `observe/chips.py`, `runtime/native.py`.
PACKAGE_MODULE = re.compile(r"`([a-z_]+(?:/[a-z_]+)+\.py)`")


def markdown_files() -> list[Path]:
    return [README, *sorted((REPO / "docs").glob("*.md"))]


def paths_in_a_fresh_clone() -> set[str]:
    """Every file a clone will have and the folders holding them: tracked, or new and not ignored.

    bench/results/ is git-ignored: a result there is in the repository only when force-added.
    """
    try:
        command = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
        listed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: which files a clone holds is unknown")
    paths = set()
    for name in filter(None, listed.split("\0")):
        parts = name.split("/")
        paths.update("/".join(parts[: end + 1]) for end in range(len(parts)))
    return paths


def test_readme_opens_with_the_two_commands_and_stays_a_landing_page():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) < README_MAX_LINES, (
        f"README.md has {len(lines)} lines: it is the landing page (under {README_MAX_LINES}); "
        "move reference text into docs/"
    )
    first_block = re.search(r"```bash\n(.*?)```", text, re.DOTALL)
    assert first_block, "README.md has no bash block"
    assert text.index("```bash") < text.index("\n## "), "the two commands come before the first section"
    commands = [line for line in first_block.group(1).splitlines() if line and not line.startswith("#")]
    assert commands == [DEMO_COMMAND, TEST_COMMAND]
    assert TEST_COMMAND in (REPO / ".ci" / "run").read_text()
    # The site's home page repeats them; they must not drift apart.
    home = (REPO / "docs" / "index.md").read_text()
    assert DEMO_COMMAND in home and TEST_COMMAND in home, "docs/index.md lost the README's two commands"


def test_every_path_the_pages_name_is_in_the_repository():
    present = paths_in_a_fresh_clone()
    missing = []
    for page in markdown_files():
        text = page.read_text()
        for match in REPOSITORY_PATH.finditer(text):
            path = match.group(1).rstrip(".")
            if any(mark in path for mark in "<>*{}"):  # a pattern (tests/test_<module>.py), not a path
                continue
            if path.rstrip("/") not in present:
                missing.append(f"{page.relative_to(REPO)}: {path}")
        for match in PACKAGE_MODULE.finditer(text):
            module = match.group(1)
            if module not in present and f"src/tpustream/{module}" not in present:
                missing.append(f"{page.relative_to(REPO)}: {module} (nor src/tpustream/{module})")
    assert not missing, (
        "named but not in a fresh clone (bench/results/ is git-ignored: cite the command that "
        "makes a result, or force-add it):\n" + "\n".join(missing)
    )


class _Ids(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.ids.update(value for name, value in attrs if name == "id" and value)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site built by mkdocs' own strict build, in process; any warning fails it."""
    from mkdocs.commands.build import build
    from mkdocs.config import load_config
    from mkdocs.exceptions import Abort

    site_dir = tmp_path_factory.mktemp("site")
    warnings: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    handler = Collect(level=logging.WARNING)
    logger = logging.getLogger("mkdocs")
    logger.addHandler(handler)
    try:
        config = load_config(str(REPO / "mkdocs.yml"), strict=True, site_dir=str(site_dir))
        build(config)
    except Abort as error:
        warnings.append(str(error))
    finally:
        logger.removeHandler(handler)
    assert not warnings, "mkdocs build --strict:\n" + "\n".join(warnings)
    return site_dir


def test_the_site_builds_strict_with_every_page_in_its_nav(site):
    pages = {page.stem for page in (REPO / "docs").glob("*.md")}
    built = {"index" if path.parent == site else path.parent.name for path in site.glob("**/index.html")}
    assert pages <= built, f"pages not built: {sorted(pages - built)}"


def test_readme_links_into_the_docs_reach_their_page_and_anchor(site):
    links = re.findall(r"\]\((docs/[^)#\s]*)(?:#([^)\s]*))?\)", README.read_text())
    linked = {Path(target).name for target, _ in links}
    unlinked = {page.name for page in (REPO / "docs").glob("*.md")} - linked
    assert not unlinked, f"README.md's Documentation list lacks {sorted(unlinked)}"
    broken = []
    for target, anchor in links:
        if not (REPO / target).is_file():
            broken.append(f"{target}: no such page")
            continue
        if not anchor:
            continue
        stem = Path(target).stem
        html = site / ("index.html" if stem == "index" else f"{stem}/index.html")
        parser = _Ids()
        parser.feed(html.read_text())
        if anchor not in parser.ids:
            broken.append(f"{target}#{anchor}: no such anchor")
    assert not broken, "README.md:\n" + "\n".join(broken)


# A command as the pages write it, from its program to the end of its line (continuations joined).
TRAIN_COMMAND = re.compile(r"python3? (train\.py|-m bench\.[\w.]+)([^`\n]*)")


def documented_overrides() -> dict[str, list[str]]:
    """Every `python train.py ...` and `python -m bench.X ... -- ...` the pages write: its Hydra overrides.

    Placeholders stay (gs://BUCKET/... is a string either way); what is not an override
    (`...`, a comment, a pipe) ends or is left out; a multirun's sweep gives its first value.
    """
    found: dict[str, list[str]] = {}
    for page in markdown_files():
        text = re.sub(r"\\\n\s*", " ", page.read_text())
        for match in TRAIN_COMMAND.finditer(text):
            program, rest = match.groups()
            rest = re.split(r"\s(?:#|\||&&|;)\s?", rest)[0]
            if program != "train.py":
                if " -- " not in f"{rest} ":
                    continue
                rest = f"{rest} ".split(" -- ", 1)[1]
            words = shlex.split(rest)
            multirun = "-m" in words or "--multirun" in words
            overrides = []
            for word in words:
                key, is_override, value = word.partition("=")
                if not is_override or key.startswith(("hydra.", "-")):
                    continue
                if multirun and "," in value and not value.startswith("["):
                    value = value.split(",")[0]
                overrides.append(f"{key}={value}")
            found[f"{page.relative_to(REPO)}: {match.group(0).strip()}"] = overrides
    return found


def test_every_documented_command_composes_as_train_py_would():
    """A key renamed or moved (`width` is `model.options.width`) fails here, naming the page and command.

    Composing is what train.py does first; the commands that need a TPU, a GPU, a bucket
    or minutes are not run, but their keys and options must still exist.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from tpustream.config import register_configs

    commands = documented_overrides()
    assert len(commands) > 30, "the pages' commands were not found"
    register_configs()
    refused, composed = {}, {}
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            for where, overrides in [*commands.items(), ("a bad key", ["model.width=8"])]:
                if tuple(overrides) not in composed:
                    try:
                        placeholders = ["output_dir=/unused", "log_dir=null"]
                        compose(config_name="config", overrides=[*placeholders, *overrides])
                        composed[tuple(overrides)] = None
                    except Exception as exc:  # Hydra raises several types; all mean "train.py would refuse"
                        composed[tuple(overrides)] = str(exc).splitlines()[0]
                if composed[tuple(overrides)] is not None:
                    refused[where] = composed[tuple(overrides)]
    finally:
        GlobalHydra.instance().clear()
    assert refused.pop("a bad key", None), "a key that does not exist composed: the check checks nothing"
    assert not refused, "\n".join(f"{where}\n    {why}" for where, why in refused.items())


# The package's commands (pyproject's [project.scripts]) and where their main() is.
COMMANDS = {
    "tpustream-make-shards": "tpustream.data.write.command",
    "tpustream-index": "tpustream.data.resolve.index_command",
    "tpustream-pod": "tpustream.pod.__main__",
    "tpustream-export": "tpustream.models.export",
    "tpustream-report": "tpustream.observe.report",
}
POD_SUBCOMMANDS = ("create", "delete", "gke-manifest")


def documented_options() -> dict[tuple[str, ...], set[str]]:
    """(command, subcommand) -> every --option the pages give it (before a `--` that starts a train.py)."""
    found: dict[tuple[str, ...], set[str]] = {}
    pattern = re.compile(rf"({'|'.join(COMMANDS)})\b([^`\n|#]*)")
    for page in markdown_files():
        text = re.sub(r"\\\n\s*", " ", page.read_text())
        for match in pattern.finditer(text):
            words = f"{match.group(2)} ".split(" -- ", 1)[0].split()
            sub = (words[0],) if words and words[0] in POD_SUBCOMMANDS else ()
            options = {w.split("=", 1)[0] for w in words if w.startswith("--") and len(w) > 2}
            found.setdefault((match.group(1), *sub), set()).update(options)
    return found


def test_every_option_the_pages_give_a_command_is_in_its_help(capsys):
    import contextlib
    import importlib

    documented = documented_options()
    assert ("tpustream-pod", "gke-manifest") in documented and ("tpustream-make-shards",) in documented
    unknown = {}
    for (program, *sub), options in documented.items():
        with contextlib.suppress(SystemExit):
            importlib.import_module(COMMANDS[program]).main([*sub, "--help"])
        helped = capsys.readouterr().out
        assert "usage" in helped.lower(), (program, sub)
        missing = sorted(o for o in options if not re.search(rf"{re.escape(o)}\b", helped))
        if missing:
            unknown[" ".join([program, *sub])] = missing
    assert not unknown, f"options the pages name that the commands do not have: {unknown}"


def written_docstring(thing: object) -> str:
    """thing's own docstring; "" for none, or for the signature a dataclass puts in its place."""
    if isinstance(thing, classmethod):
        thing = thing.__func__
    doc = inspect.getdoc(thing) or ""
    return "" if doc.startswith(f"{getattr(thing, '__name__', '')}(") else doc


def own_public_members(cls: type) -> dict[str, object]:
    """The methods and properties a class defines itself, not starting with _."""
    kinds = (property, classmethod, staticmethod)
    return {
        name: value
        for name, value in vars(cls).items()
        if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, kinds))
    }


def test_the_public_names_import_from_tpustream_data_and_each_has_its_entry_on_the_api_page():
    """docs/api.md documents exactly tpustream.data's exports, under the names users import.

    A name added or removed changes both; each has a written docstring, and so do a public
    class's own methods and properties (the page leaves out what has none).
    """
    import tpustream.data as data

    page = (REPO / "docs" / "api.md").read_text()
    documented = set(re.findall(r"^::: ([\w.]+)$", page, flags=re.MULTILINE))
    assert documented == {f"tpustream.data.{name}" for name in data.__all__}
    assert data.__all__ == sorted(data.PUBLIC)
    undocumented = []
    for name in data.__all__:
        exported = getattr(data, name)
        assert exported.__module__ == data.PUBLIC[name], name
        members = own_public_members(exported) if inspect.isclass(exported) else {}
        things = {name: exported} | {f"{name}.{member}": value for member, value in members.items()}
        undocumented += [qualified for qualified, thing in things.items() if not written_docstring(thing)]
    assert not undocumented, f"public names without a docstring (docs/api.md shows none): {undocumented}"
    with pytest.raises(AttributeError, match="no attribute 'plan'"):
        data.plan  # noqa: B018
