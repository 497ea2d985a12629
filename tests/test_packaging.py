"""What the Comfy registry and ComfyUI Manager read: pyproject.toml, requirements.txt, the web folder."""
import re
import tomllib
from importlib.metadata import version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

PACK_ROOT = Path(__file__).resolve().parent.parent


def pyproject():
    return tomllib.loads((PACK_ROOT / "pyproject.toml").read_text())


def test_project_table_is_complete():
    project = pyproject()["project"]
    assert re.fullmatch(r"[a-z0-9][a-z0-9-]*", project["name"])  # the registry's node id
    Version(project["version"])  # PEP 440, or this raises
    assert len(project["description"]) > 40
    assert project["dependencies"]
    assert project["license"] and project["requires-python"]


def test_registry_fields_present():
    comfy = pyproject()["tool"]["comfy"]
    assert comfy["PublisherId"] and comfy["DisplayName"]
    # The icon URL points into this repository; the file must be there.
    icon = re.search(r"/main/(.+)$", comfy["Icon"])
    assert comfy["Icon"].startswith("https://") and icon, comfy["Icon"]
    assert (PACK_ROOT / icon.group(1)).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # ComfyUI serves [tool.comfy] web under the project name as well as WEB_DIRECTORY under the
    # folder name: both would load the extension twice.
    assert "web" not in comfy


def test_requirements_txt_matches_pyproject_dependencies():
    # Manager installs requirements.txt, the registry reads pyproject: the same packages.
    lines = (PACK_ROOT / "requirements.txt").read_text().splitlines()
    from_txt = {Requirement(line).name for line in lines if line.strip() and not line.startswith("#")}
    from_toml = {Requirement(dep).name for dep in pyproject()["project"]["dependencies"]}
    assert from_txt == from_toml
    # torch comes with ComfyUI; a requirement on it would let pip replace ComfyUI's CUDA build.
    assert "torch" not in from_txt


def test_comfy_kitchen_requirement_admits_the_tested_version():
    # .ci/run runs these tests in each host's venv: 0.2.40 beside ComfyUI 0.3.75, and upstream
    # ComfyUI 0.33.0's pin 0.2.31. Admitting the host's pin keeps Manager from upgrading it.
    (kitchen,) = [Requirement(dep) for dep in pyproject()["project"]["dependencies"]
                  if Requirement(dep).name == "comfy-kitchen"]
    assert kitchen.specifier.contains(version("comfy-kitchen")), (str(kitchen), version("comfy-kitchen"))


def test_web_directory_holds_the_extension_and_docs():
    init = (PACK_ROOT / "__init__.py").read_text()
    web = re.search(r'WEB_DIRECTORY = "\./(\w+)"', init).group(1)
    assert (PACK_ROOT / web / "js" / "bigdit_report.js").exists()
    assert list((PACK_ROOT / web / "docs").glob("*.md"))


# comfy-cli's checks of these fields (comfy_cli/registry/config_parser.py): it warns and drops a
# value it does not accept, so a typo would publish no OS, GPU or ComfyUI information.
REGISTRY_OS_PREFIXES = ("Microsoft", "POSIX", "MacOS", "OS Independent")
REGISTRY_ACCELERATORS = {"GPU :: NVIDIA CUDA", "GPU :: AMD ROCm", "GPU :: Intel Arc", "NPU :: Huawei Ascend",
                         "GPU :: Apple Metal"}
REGISTRY_VERSION = re.compile(r"^(?:(==|>=|<=|!=|~=|>|<|<>|=)\s*)?(\d+\.\d+\.\d+(?:-[a-zA-Z0-9]+)?)?$")


def test_registry_classifiers_and_comfyui_floor():
    from comfy_harness import HOSTS
    classifiers = pyproject()["project"]["classifiers"]
    systems = [c.removeprefix("Operating System :: ") for c in classifiers if c.startswith("Operating System :: ")]
    accelerators = [c.removeprefix("Environment :: ") for c in classifiers if c.startswith("Environment ::")]
    assert systems and all(s.startswith(REGISTRY_OS_PREFIXES) for s in systems), systems
    assert accelerators and set(accelerators) <= REGISTRY_ACCELERATORS, accelerators
    floor = pyproject()["tool"]["comfy"]["requires-comfyui"]
    assert REGISTRY_VERSION.match(floor), floor
    # The floor is the oldest ComfyUI the integration tests run on.
    oldest = min(HOSTS, key=lambda h: tuple(int(p) for p in h.version.split(".")))
    assert floor == f">={oldest.version}"


def published_files() -> set[str]:
    """The files comfy-cli's `comfy node pack` puts in the registry archive: git-tracked files minus
    .comfyignore (its patterns here are anchored literals, so prefix matching is exact), plus
    `includes` (which would override .comfyignore)."""
    import subprocess
    patterns = [line.strip() for line in (PACK_ROOT / ".comfyignore").read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    assert all(p.startswith("/") and not set(p) & set("*?[]!\\") for p in patterns), patterns
    tracked = subprocess.run(["git", "-C", str(PACK_ROOT), "ls-files"], capture_output=True, text=True,
                             check=True).stdout.split()
    includes = pyproject()["tool"]["comfy"].get("includes", [])

    def ignored(path):
        if any(path == inc or path.startswith(inc.rstrip("/") + "/") for inc in includes):
            return False
        return any(path.startswith(p[1:]) if p.endswith("/") else path == p[1:] or path.startswith(p[1:] + "/")
                   for p in patterns)

    return {path for path in tracked if not ignored(path)}


def test_registry_archive_holds_the_pack_and_no_tests():
    files = published_files()
    for kept in ("__init__.py", "dtypes.py", "pack_logging.py", "pyproject.toml", "requirements.txt", "LICENSE", "README.md",
                 "web/js/bigdit_report.js", "web/icon.png"):
        assert kept in files, kept
    for package in ("nodes", "quant", "loaders", "offload", "attention"):
        modules = {str(p.relative_to(PACK_ROOT)) for p in (PACK_ROOT / package).glob("*.py")}
        assert modules and modules <= files, package
    assert {f"web/docs/{p.name}" for p in (PACK_ROOT / "web" / "docs").glob("*.md")} <= files
    assert any(f.startswith("example_workflows/") and f.endswith(".json") for f in files)
    for left_out in ("tests/", ".ci/", "web/screenshots/", "docs/"):
        assert not any(f.startswith(left_out) for f in files), left_out
