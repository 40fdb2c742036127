"""Static checks of the Dockerfile: no Docker engine here, so we read it and run its own snippet.

What matters for an image that trains on a TPU VM: it installs exactly pyproject.toml's pins
(plus the `tpu` extra by default), the install layer comes before the source so it caches,
everything train.py needs is copied, and the documented `docker run` line can reach the TPU.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

# The Dockerfile's snippet reads pyproject.toml with tomllib (Python 3.11+, as in the
# image) and these tests run that snippet with this interpreter.
tomllib = pytest.importorskip("tomllib", reason="needs Python 3.11+, like the image's requirements step")

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "Dockerfile"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
# What the entrypoint and the package need at run time and at `pip install -e .`:
# train.py and its Hydra config folder, the package, the helper scripts, and the
# two files setuptools reads (pyproject.toml, and README.md as its `readme`).
NEEDED_IN_IMAGE = ("train.py", "conf", "src", "scripts", "pyproject.toml", "README.md")
SOURCE_PATHS = ("train.py", "conf", "src", "scripts", "README.md")
# `docker run` flags that take their value as the next word.
RUN_FLAGS_WITH_VALUE = {"--net", "--network", "--shm-size", "--ipc", "--name", "-v", "--volume", "-e"}


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    line: int
    heredoc: str | None = None


def parse_dockerfile(text: str) -> tuple[list[str], list[Instruction]]:
    """The header comment (text of the leading # lines) and the instructions.

    Continuation lines are joined; a heredoc body (RUN cmd <<'END' ... END) is
    attached to its instruction.
    """
    lines = text.splitlines()
    header: list[str] = []
    index = 0
    while index < len(lines) and lines[index].startswith("#"):
        comment = lines[index][1:]
        if not re.match(r"\s*syntax\s*=", comment):  # the parser directive is not documentation
            header.append(comment)
        index += 1
    instructions: list[Instruction] = []
    while index < len(lines):
        start = index
        logical = lines[index].strip()
        index += 1
        if not logical or logical.startswith("#"):
            continue
        while logical.endswith("\\"):
            logical = logical[:-1].rstrip() + " " + lines[index].strip()
            index += 1
        keyword, _, args = logical.partition(" ")
        heredoc = None
        marker = re.search(r"<<-?(['\"]?)(\w+)\1", args)
        if marker:
            body_end = lines.index(marker.group(2), index)
            heredoc = "\n".join(lines[index:body_end]) + "\n"
            index = body_end + 1
        instructions.append(Instruction(keyword.upper(), args.strip(), start + 1, heredoc))
    return header, instructions


HEADER, INSTRUCTIONS = parse_dockerfile(DOCKERFILE.read_text())


def instructions(keyword: str) -> list[tuple[int, Instruction]]:
    return [(i, ins) for i, ins in enumerate(INSTRUCTIONS) if ins.keyword == keyword]


def copy_sources(instruction: Instruction) -> tuple[list[str], str]:
    """(sources, destination) of a COPY, shell or JSON form, flags such as --chown dropped."""
    if instruction.args.startswith("["):
        words = json.loads(instruction.args)
    else:
        words = [w for w in shlex.split(instruction.args) if not w.startswith("--")]
    return [w.removeprefix("./").rstrip("/") or "." for w in words[:-1]], words[-1]


def is_copied(path: str) -> bool:
    """Whether some COPY puts `path` (a file or folder of the repository) into the image."""
    sources = [source for _, ins in instructions("COPY") for source in copy_sources(ins)[0]]
    return any(source == "." or path == source or path.startswith(source + "/") for source in sources)


def build_args() -> dict[str, str]:
    """ARG defaults of the Dockerfile."""
    args = {}
    for _, instruction in instructions("ARG"):
        name, _, default = instruction.args.partition("=")
        args[name] = default.strip("\"'")
    return args


def requirements_step() -> tuple[int, Instruction, str]:
    """The RUN that writes the requirements file from pyproject.toml, and that file's path."""
    for index, instruction in instructions("RUN"):
        redirect = re.search(r">\s*(\S+)", instruction.args)
        if instruction.heredoc and redirect and "pyproject.toml" in instruction.heredoc:
            return index, instruction, redirect.group(1)
    pytest.fail("no RUN with a heredoc that writes requirements from pyproject.toml")


def run_requirements_snippet(tmp_path: Path, extras: str) -> list[str]:
    """Run the Dockerfile's own snippet beside a copy of pyproject.toml alone, as the build does."""
    _, instruction, _ = requirements_step()
    workdir = tmp_path / f"extras-{extras.replace(',', '-')}"
    workdir.mkdir()
    shutil.copy(REPO / "pyproject.toml", workdir / "pyproject.toml")
    result = subprocess.run(
        [sys.executable, "-"],
        input=instruction.heredoc,
        cwd=workdir,
        env={**os.environ, "EXTRAS": extras},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return result.stdout.splitlines()


def expected_requirements(extras: str) -> list[str]:
    chosen = [e for e in extras.split(",") if e]
    return PYPROJECT["dependencies"] + [d for e in chosen for d in PYPROJECT["optional-dependencies"][e]]


def pins(requirements: list[str], package: str) -> list[tuple[str, frozenset[str]]]:
    """(specifier, extras) of every requirement naming `package`."""
    parsed = [Requirement(line) for line in requirements]
    return [
        (str(r.specifier), frozenset(r.extras))
        for r in parsed
        if canonicalize_name(r.name) == canonicalize_name(package)
    ]


def documented_commands(program: str) -> list[list[str]]:
    """The `docker build` / `docker run` lines of the header comment, continuations joined, as words."""
    commands, pending = [], ""
    for comment in HEADER:
        text = comment.strip()
        if pending:
            text = pending + " " + text
            pending = ""
        if text.endswith("\\"):
            pending = text[:-1].rstrip()
            continue
        code = text.split(" #", 1)[0]  # drop a trailing comment
        if code.startswith(f"docker {program} "):
            commands.append(shlex.split(code))
    return commands


def base_python_version() -> tuple[int, int]:
    (_, instruction), *_ = instructions("FROM")
    match = re.fullmatch(r"(?:docker\.io/)?(?:library/)?python:(\d+)\.(\d+)\S*", instruction.args.split()[0])
    assert match, f"base image {instruction.args!r} is not an official python:X.Y image"
    return int(match.group(1)), int(match.group(2))


@pytest.mark.parametrize("extras", ["tpu", "dev", "", "tpu,bench"])
def test_requirements_snippet_yields_exactly_the_pyproject_pins(tmp_path, extras):
    assert run_requirements_snippet(tmp_path, extras) == expected_requirements(extras)


def test_requirements_file_is_what_pip_installs():
    index, _, path = requirements_step()
    installs = [i for i, ins in instructions("RUN") if f"pip install -r {path}" in ins.args]
    assert installs and installs[0] > index, f"no `pip install -r {path}` after the step that writes it"


def test_default_build_installs_the_tpu_extra(tmp_path):
    default = build_args().get("EXTRAS")
    assert default == "tpu", f"ARG EXTRAS defaults to {default!r}; the default image must be the TPU one"
    requirements = run_requirements_snippet(tmp_path, default)
    assert ("==2.9.0", frozenset({"tpu"})) in pins(requirements, "torch_xla"), requirements
    assert "torch_xla[tpu]==2.9.0" in PYPROJECT["optional-dependencies"]["tpu"]


def test_torch_pins_are_the_versions_the_readme_states(tmp_path):
    readme = (REPO / "README.md").read_text()
    stated = re.search(r"torch ([0-9][0-9.]*[0-9]), torch_xla ([0-9][0-9.]*[0-9])", readme)
    assert stated, "README.md does not state 'torch X, torch_xla Y'"
    requirements = run_requirements_snippet(tmp_path, build_args()["EXTRAS"])
    for package, version in zip(("torch", "torch_xla"), stated.groups(), strict=True):
        found = pins(requirements, package)
        assert found, f"the image does not install {package}"
        # Pinned exactly (the tpu extra), and every other requirement (the base's lower bound) allows it.
        assert f"=={version}" in {specifier for specifier, _ in found}, f"{package} not pinned to {version}"
        for specifier, _ in found:
            assert SpecifierSet(specifier).contains(version), f"{package}{specifier}, README says {version}"


def test_base_image_python_is_supported():
    version = base_python_version()
    assert (3, 10) <= version <= (3, 12), f"python {version} in the image; the project supports 3.10-3.12"
    assert SpecifierSet(PYPROJECT["requires-python"]).contains("{}.{}".format(*version))
    _, instruction, _ = requirements_step()
    if "tomllib" in instruction.heredoc:
        assert version >= (3, 11), "the requirements snippet imports tomllib, which needs Python 3.11+"


def test_everything_the_image_runs_is_copied():
    missing = [path for path in NEEDED_IN_IMAGE if not is_copied(path)]
    assert not missing, f"not copied into the image: {missing}"
    assert is_copied(PYPROJECT["readme"]), "pyproject.toml's readme must be in the image for `pip install .`"
    config_path = re.search(r"config_path=\"([^\"]+)\"", (REPO / "train.py").read_text())
    assert config_path and is_copied(config_path.group(1)), "train.py's Hydra config folder is not copied"
    copied = {source for _, ins in instructions("COPY") for source in copy_sources(ins)[0]}
    absent = [source for source in copied if not (REPO / source).exists()]
    assert not absent, f"COPY sources that do not exist in the repository: {absent}"


def test_dependencies_install_before_the_source_is_copied():
    copies = instructions("COPY")
    generate, _, path = requirements_step()
    install = next(i for i, ins in instructions("RUN") if f"pip install -r {path}" in ins.args)
    early = [copy_sources(ins)[0] for i, ins in copies if i < install]
    assert early == [["pyproject.toml"]], (
        f"only pyproject.toml may be copied before the dependency layer (or edits bust its cache): {early}"
    )
    pyproject_copy = next(i for i, ins in copies if copy_sources(ins)[0] == ["pyproject.toml"])
    first_source = min(i for i, ins in copies if set(copy_sources(ins)[0]) & set(SOURCE_PATHS))
    assert pyproject_copy < generate < install < first_source
    package_installs = [ins.args for i, ins in instructions("RUN") if i > first_source and "pip" in ins.args]
    assert package_installs, "the package itself is never installed"
    assert all("--no-deps" in args for args in package_installs), "re-resolving deps after the source copy"


def test_entrypoint_is_train_py_so_run_arguments_are_overrides():
    entrypoints = instructions("ENTRYPOINT")
    assert entrypoints, "no ENTRYPOINT: `docker run IMAGE data=cifar10` would try to execute `data=cifar10`"
    assert json.loads(entrypoints[-1][1].args) == ["python", "train.py"]
    (_, workdir), *_ = instructions("WORKDIR")
    copies = [copy_sources(ins) for _, ins in instructions("COPY")]
    destinations = [destination for sources, destination in copies if "train.py" in sources]
    assert destinations and all(d.rstrip("/") in (".", workdir.args.rstrip("/")) for d in destinations)
    for _, cmd in instructions("CMD"):
        arguments = json.loads(cmd.args)
        assert arguments and "python" not in arguments[0], "CMD is appended to the entrypoint: arguments only"


def test_documented_run_line_reaches_the_tpu():
    (run,) = documented_commands("run")
    assert "--privileged" in run, "a TPU VM container needs --privileged for the TPU devices"
    flags = set(run) | {f"{flag}={value}" for flag, value in zip(run, run[1:], strict=False)}
    assert flags & {"--net=host", "--network=host"}, "a TPU VM container needs --net=host"
    shared_memory = [w for w in flags if w.startswith("--shm-size=") or w == "--ipc=host"]
    assert shared_memory, "DataLoader workers pass batches through /dev/shm: set --shm-size"
    words = iter(run[2:])
    for word in words:
        if not word.startswith("-"):
            image = word
            break
        if word in RUN_FLAGS_WITH_VALUE:
            next(words)
    overrides = list(words)
    built = {build[build.index("-t") + 1] for build in documented_commands("build")}
    assert image in built, f"`docker run` uses {image!r}, the header builds {sorted(built)}"
    assert "accelerator=tpu" in overrides
    assert overrides and all(re.fullmatch(r"[\w.+~]+=\S+", o) for o in overrides), (
        f"arguments after the image go to `python train.py` and must be Hydra overrides: {overrides}"
    )


def test_documented_build_args_exist():
    args = build_args()
    for build in documented_commands("build"):
        for flag, value in zip(build, build[1:], strict=False):
            if flag == "--build-arg":
                name, _, setting = value.partition("=")
                assert name in args, f"--build-arg {name} is not an ARG of the Dockerfile"
                if name == "EXTRAS":
                    assert set(setting.split(",")) <= set(PYPROJECT["optional-dependencies"])


def test_dockerignore_keeps_the_copied_files_and_drops_the_venv():
    patterns = [
        line.strip().lstrip("/")
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]

    def ignored(path: str) -> bool:
        parts = path.split("/")
        prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
        return any(
            fnmatch.fnmatch(prefix, pattern) or fnmatch.fnmatch(prefix, pattern.removeprefix("**/"))
            for pattern in patterns
            for prefix in prefixes
        )

    copied = [source for _, ins in instructions("COPY") for source in copy_sources(ins)[0]]
    assert not [path for path in copied if ignored(path)], "a COPY source is excluded by .dockerignore"
    assert ignored(".venv") and ignored(".git")
