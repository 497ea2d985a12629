"""loaders/host_memory.py `free_ram`: the host memory a process can take without pushing out anything in use, read
from /proc/meminfo and the process's memory cgroups (v2 and v1), here from planted copies of those files."""
import pytest

from bigdit.loaders import host_memory

GIB = 1 << 30
KB = 1024

# a machine after loading a model: little free, the model file's pages in the page cache (active), others inactive;
# MemAvailable (psutil's `available`) counts both
MEMINFO = f"""MemTotal:       {128 * GIB // KB} kB
MemFree:        {2 * GIB // KB} kB
MemAvailable:   {60 * GIB // KB} kB
Active(file):   {40 * GIB // KB} kB
Inactive(file): {16 * GIB // KB} kB
"""


@pytest.fixture
def system(tmp_path, monkeypatch):
    """Planted /proc/meminfo, /proc/self/cgroup and cgroup mount; returns a function writing a cgroup's files."""
    (tmp_path / "meminfo").write_text(MEMINFO)
    root = tmp_path / "cgroup"
    root.mkdir()
    monkeypatch.setattr(host_memory, "MEMINFO", str(tmp_path / "meminfo"))
    monkeypatch.setattr(host_memory, "SELF_CGROUP", str(tmp_path / "self_cgroup"))
    monkeypatch.setattr(host_memory, "CGROUP_ROOT", str(root))

    def cgroup(self_lines: str, folder: str, files: dict[str, str]):
        (tmp_path / "self_cgroup").write_text(self_lines)
        where = root / folder
        where.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (where / name).write_text(text)
        return where

    return cgroup


def test_free_memory_and_inactive_page_cache_count_the_page_cache_in_use_does_not(system):
    system("0::/\n", "", {})  # cgroup v2 at the root: no memory.max there
    assert host_memory.free_ram() == 18 * GIB  # not psutil's 60 GiB


def test_a_cgroup_v2_limit_binds_with_its_own_inactive_page_cache(system):
    system("0::/job/server\n", "job", {"memory.max": str(64 * GIB), "memory.current": str(60 * GIB),
                                       "memory.stat": f"anon 50\ninactive_file {1 * GIB}\nactive_file 7\n"})
    system("0::/job/server\n", "job/server", {"memory.max": "max", "memory.current": str(60 * GIB)})
    assert host_memory.free_ram() == 5 * GIB  # 64 - 60 + 1 in the limited parent, tighter than the machine's 18


def test_the_tightest_cgroup_v1_limit_binds(system):
    no_limit = str(9223372036854771712)
    system("4:memory:/a/b\n1:cpu:/\n", "memory", {"memory.limit_in_bytes": no_limit,
                                                    "memory.usage_in_bytes": str(100 * GIB)})
    system("4:memory:/a/b\n1:cpu:/\n", "memory/a", {"memory.limit_in_bytes": str(32 * GIB),
                                                     "memory.usage_in_bytes": str(30 * GIB),
                                                     "memory.stat": f"total_inactive_file {GIB}\n"})
    system("4:memory:/a/b\n1:cpu:/\n", "memory/a/b", {"memory.limit_in_bytes": str(40 * GIB),
                                                       "memory.usage_in_bytes": str(30 * GIB)})
    assert host_memory.free_ram() == 3 * GIB


def test_a_cgroup_path_the_mount_does_not_show_counts_as_its_root(system):
    # a container's own namespace: /proc/self/cgroup names the host's path, the mount shows the container's cgroup
    system("0::/kubepods/pod1/ctr\n", "", {"memory.max": str(8 * GIB), "memory.current": str(7 * GIB)})
    assert host_memory.free_ram() == GIB


def test_without_meminfo_it_says_nothing(system, monkeypatch):
    monkeypatch.setattr(host_memory, "MEMINFO", "/nonexistent/meminfo")
    assert host_memory.free_ram() is None


def test_on_this_machine_it_is_at_most_what_psutil_calls_available():
    psutil = pytest.importorskip("psutil")
    free = host_memory.free_ram()
    if free is None:
        pytest.skip("no /proc/meminfo here")
    # the page cache in use is left out; a cgroup's limit only lowers it (allow for memory freed in between)
    assert 0 <= free <= psutil.virtual_memory().available + 256 * 1024 * 1024
