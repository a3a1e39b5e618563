#!/usr/bin/env python3
"""Fetch, verify, patch and install the pinned llama-cpp-python engine.

Steps (each one loud on failure):
  1. download the pinned sdist from the package registry (pip download), unless cached;
  2. verify its size and sha256 against vendor/PIN;
  3. unpack it under vendor/src/ (git-ignored) once;
  4. apply patches/*.patch in order to the vendored llama.cpp (a patch with the trailer
     `Applies-To: llama-cpp-python` to the package's own Python files); a changed patch series is
     first reverse-applied, so the tree and the persistent build directory stay incremental;
  5. pip-install the patched package into the current environment with a persistent
     CMake build directory (vendor/build/<backend>), so a rebuild after a patch edit only
     recompiles what changed.

The patch-set id (sha256 over the patch files, in order) is compiled into the library and
returned by llama_kvlocal_build_id(); kvlocal compares it with the repository's patches.

Usage: python vendor/build_engine.py [--backend cpu|cuda|metal|vulkan] [--cuda-arch 90]
       [--jobs N] [--tests] [--tests-only] [--compile-check] [--prepare-only] [--print-id]
       [--wheel DIR] [--make-pack FILE | --from-pack FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

VENDOR = Path(__file__).resolve().parent
ROOT = VENDOR.parent
PATCHES = ROOT / "patches"
SRC = VENDOR / "src"
BUILD = VENDOR / "build"
DOWNLOADS = VENDOR / "downloads"


def read_pin() -> dict[str, str]:
    pin = {}
    for line in (VENDOR / "PIN").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            pin[key.strip()] = value.strip()
    return pin


sys.path.insert(0, str(ROOT))
from kvlocal.patchset import patch_files, patch_root, patchset_id  # noqa: E402  (stdlib only)


def say(msg: str) -> None:
    print(f"[build_engine] {msg}", file=sys.stderr, flush=True)


def die(msg: str) -> None:
    say(f"error: {msg}")
    sys.exit(1)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_sdist(pin: dict[str, str]) -> Path:
    name = f"llama_cpp_python-{pin['version']}.tar.gz"
    target = DOWNLOADS / name
    if not target.exists():
        DOWNLOADS.mkdir(parents=True, exist_ok=True)
        say(f"downloading llama-cpp-python=={pin['version']} sdist from the package registry")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:",
             "--no-build-isolation", f"llama-cpp-python=={pin['version']}", "-d", str(DOWNLOADS)],
            check=True, stdout=sys.stderr,
        )
    if target.stat().st_size != int(pin["size"]):
        die(f"{name}: size {target.stat().st_size} != pinned {pin['size']}; delete {target} and retry")
    digest = sha256_file(target)
    if digest != pin["sha256"]:
        die(f"{name}: sha256 {digest} != pinned {pin['sha256']}; delete {target} and retry")
    say(f"verified {name} (sha256 {digest[:12]}…)")
    return target


def unpack(sdist: Path, pin: dict[str, str]) -> Path:
    tree = SRC / f"llama_cpp_python-{pin['version']}"
    if not (tree / "pyproject.toml").exists():
        SRC.mkdir(parents=True, exist_ok=True)
        say(f"unpacking into {tree.relative_to(ROOT)}")
        with tarfile.open(sdist) as tar:
            tar.extractall(SRC, filter="data")
    return tree


# A pack is the patched source tree without what a build never reads (llama.cpp's vocab models,
# docs, tools, examples, all tests but test-backend-ops, built libraries; ggml stays whole), for a machine that
# reaches no package registry: the 76.6 MB sdist becomes a few MB. Its manifest names the sdist
# it came from and the patch set it carries; building from it checks that set against patches/.
PACK_MANIFEST = ".kvlocal-pack.json"
PACK_DROP = (
    "docs", "docker", "examples", "tests", "scripts", "llama_cpp/lib",
    "vendor/llama.cpp/models", "vendor/llama.cpp/docs", "vendor/llama.cpp/tools", "vendor/llama.cpp/media",
    "vendor/llama.cpp/benches", "vendor/llama.cpp/examples", "vendor/llama.cpp/gguf-py",
    "vendor/llama.cpp/scripts", "vendor/llama.cpp/conversion", "vendor/llama.cpp/.github",
    "vendor/llama.cpp/.devops",
)
PACK_KEEP = ("vendor/llama.cpp/tests/test-backend-ops.cpp",)


def pack_make(tree: Path, pin: dict[str, str], set_id: str, out: Path) -> None:
    """Write the patched tree, trimmed, as a .tar.gz with a manifest."""
    import io
    import json

    def keep(rel: str) -> bool:
        if any(part.startswith(".git") for part in rel.split("/")):
            return False  # a developer's git data (.git, .github, .gitmodules)
        if rel in PACK_KEEP:
            return True
        if rel == "vendor/llama.cpp/tests":
            return True  # the folder itself, for the one file kept in it
        if rel.startswith("vendor/llama.cpp/tests/"):
            return False
        return not any(rel == d or rel.startswith(d + "/") for d in PACK_DROP)

    manifest = {
        "sdist": f"llama_cpp_python-{pin['version']}.tar.gz", "sdist_sha256": pin["sha256"],
        "patchset": set_id, "patches": [p.name for p in patch_files()],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    root = f"kvlocal-engine-{set_id}"
    with tarfile.open(tmp, "w:gz") as tar:
        for path in sorted(tree.rglob("*")):
            rel = path.relative_to(tree).as_posix()
            if path.is_file() and not path.is_symlink() and keep(rel):
                tar.add(path, arcname=f"{root}/{rel}", recursive=False)
        data = json.dumps(manifest, indent=2).encode()
        info = tarfile.TarInfo(f"{root}/{PACK_MANIFEST}")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    tmp.replace(out)
    say(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB): patch set {set_id}, from {manifest['sdist']}")


def pack_unpack(pack: Path) -> tuple[Path, str]:
    """Unpack a pack under vendor/src/ (once per patch set) and check it carries patches/."""
    import json

    if not pack.is_file():
        die(f"no pack at {pack} (make one with --make-pack on a machine that reaches the registry)")
    want = patchset_id(patch_files())
    try:
        with tarfile.open(pack) as tar:
            root = tar.getnames()[0].split("/", 1)[0]
            manifest = json.load(tar.extractfile(f"{root}/{PACK_MANIFEST}"))
    except (tarfile.TarError, IndexError, KeyError, ValueError) as err:
        die(f"{pack} is not a kvlocal engine pack ({err})")
    if manifest.get("patchset") != want:
        die(f"{pack} carries patch set {manifest.get('patchset')}, but patches/ is {want}; make a new pack")
    tree = SRC / root
    if not (tree / PACK_MANIFEST).exists():  # the manifest is the pack's last member: its presence means complete
        SRC.mkdir(parents=True, exist_ok=True)
        say(f"unpacking {pack.name} into {tree}")
        with tarfile.open(pack) as tar:
            tar.extractall(SRC, filter="data")
    say(f"building from pack {pack.name}: {manifest['sdist']} (sha256 {manifest['sdist_sha256'][:12]}…) "
        f"+ patch set {want}")
    return tree, want


def run_patch(tree: Path, patch: Path, *extra: str) -> subprocess.CompletedProcess:
    """Apply (or with --reverse, revert) one patch in its root: llama.cpp, or the bindings' package."""
    return subprocess.run(
        ["patch", "-p1", "--forward", "--no-backup-if-mismatch", "-r", "-", "-s", *extra, "-i", str(patch)],
        cwd=tree / patch_root(patch), capture_output=True, text=True,
    )


def apply_patches(tree: Path) -> str:
    applied_dir = tree / ".kvlocal-applied"
    patches = patch_files()
    wanted = [(p.name, p.read_bytes()) for p in patches]
    applied = sorted(applied_dir.glob("*.patch")) if applied_dir.exists() else []
    have = [(p.name, p.read_bytes()) for p in applied]

    # keep the common prefix, reverse the rest (newest first), then apply what is missing
    common = 0
    while common < min(len(wanted), len(have)) and wanted[common] == have[common]:
        common += 1
    before = file_stamps(tree, applied[common:] + patches[common:])
    for path in reversed(applied[common:]):
        say(f"reverting {path.name}")
        res = run_patch(tree, path, "--reverse")
        if res.returncode != 0:
            die(f"could not revert {path.name}:\n{res.stdout}{res.stderr}\n"
                f"remove {tree} to start from a clean sdist")
        path.unlink()
    applied_dir.mkdir(exist_ok=True)
    for path in patches[common:]:
        say(f"applying {path.name}")
        dry = run_patch(tree, path, "--dry-run")
        if dry.returncode != 0:
            die(f"{path.name} does not apply to llama.cpp {tree.name}:\n{dry.stdout}{dry.stderr}")
        res = run_patch(tree, path)
        if res.returncode != 0:
            die(f"{path.name} failed to apply:\n{res.stdout}{res.stderr}")
        shutil.copyfile(path, applied_dir / path.name)
    restore_unchanged_mtimes(tree, before)
    return patchset_id(patches)


def patched_paths(patches: list[Path]) -> set[str]:
    """The files (relative to the unpacked sdist) that the patches touch."""
    found = set()
    for patch in patches:
        root = Path(patch_root(patch))
        for line in patch.read_text(errors="replace").splitlines():
            if line.startswith(("--- a/", "+++ b/")):
                found.add((root / line[6:].split("\t")[0]).as_posix())
    return found


def file_stamps(tree: Path, patches: list[Path]) -> dict[str, tuple[int, str]]:
    """(mtime, sha256) of every existing file the patches touch."""
    stamps = {}
    for rel in patched_paths(patches):
        path = tree / rel
        if path.is_file():
            stamps[rel] = (path.stat().st_mtime_ns, sha256_file(path))
    return stamps


def restore_unchanged_mtimes(tree: Path, before: dict[str, tuple[int, str]]) -> None:
    """A file that reverting and re-applying left with the same bytes gets its old mtime back, so the
    persistent build directory recompiles only what really changed (a patch's header, or a later
    patch of the series, no longer rebuilds everything the series touches)."""
    for rel, (mtime_ns, digest) in before.items():
        path = tree / rel
        if path.is_file() and sha256_file(path) == digest:
            os.utime(path, ns=(mtime_ns, mtime_ns))


def cmake_args(backend: str, cuda_arch: str | None, set_id: str) -> list[str]:
    args = [
        "-DLLAVA_BUILD=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_TOOLS=OFF",
        "-DLLAMA_BUILD_SERVER=OFF",
        f"-DKVLOCAL_PATCHSET_ID={set_id}",
    ]
    if backend in ("cpu", "vulkan") and platform.machine() in ("x86_64", "AMD64"):
        # GGML_NATIVE on an AMX-capable CPU crashes every decode in ggml_backend_amx_mul_mat
        # (see DESIGN.md); keep native tuning but leave AMX out. A Vulkan build compiles the CPU
        # backend too (the fallback for ops Vulkan lacks, and test-backend-ops' reference).
        flags = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        args += [f"-DCMAKE_C_FLAGS={flags}", f"-DCMAKE_CXX_FLAGS={flags}"]
    if backend == "cpu":
        # the RPC backend (layers, their weights and KV on other machines) and its server, ggml-rpc-server,
        # built in the same configuration and installed in llama_cpp/lib (vendor/rpc_server.cmake)
        args += ["-DGGML_RPC=ON", f"-DCMAKE_PROJECT_llama_cpp_INCLUDE={VENDOR / 'rpc_server.cmake'}"]
    if backend == "cuda":
        args += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={cuda_arch or 'native'}"]
    elif backend == "metal":
        args += ["-DGGML_METAL=ON", "-DGGML_METAL_EMBED_LIBRARY=ON"]
    elif backend == "vulkan":
        # needs the Vulkan loader and headers, glslc and SPIRV-Headers (Debian: libvulkan-dev glslc
        # spirv-headers; Mesa's lavapipe, mesa-vulkan-drivers, runs it on a CPU); every shader is
        # compiled with glslc at build time, which is most of a fresh build
        args += ["-DGGML_VULKAN=ON"]
    return args


def cuda_toolkit_args() -> list[str]:
    """CMake's view of the toolkit that CUDAToolkit_ROOT names (e.g. one assembled from the registry's
    nvidia-cuda-nvcc, -runtime, -crt, -cccl, -nvvm and nvidia-cublas wheels, with a driver stub in
    lib64/stubs)."""
    toolkit = os.environ.get("CUDAToolkit_ROOT")
    if toolkit and (Path(toolkit) / "bin" / "nvcc").exists():
        return [f"-DCUDAToolkit_ROOT={toolkit}", f"-DCMAKE_CUDA_COMPILER={Path(toolkit) / 'bin' / 'nvcc'}"]
    return []


def install(tree: Path, backend: str, cuda_arch: str | None, jobs: int, set_id: str,
            wheel_dir: Path | None = None) -> None:
    """pip-install the patched package into this environment, or with wheel_dir write its wheel there
    (a built engine to carry to a machine that should not compile it)."""
    if backend == "vulkan":
        check_vulkan_headers()
    # one persistent build directory per source tree (CMake ties a build directory to its source)
    build_dir = BUILD / (backend if tree.parent == SRC and tree.name.startswith("llama_cpp_python-") else f"{backend}-pack")
    build_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.pop("CMAKE_ARGS", None)
    env["CMAKE_BUILD_PARALLEL_LEVEL"] = str(jobs)
    # each -DKEY=VALUE becomes a scikit-build-core define, so values may hold spaces
    defines = []
    for arg in cmake_args(backend, cuda_arch, set_id) + (cuda_toolkit_args() if backend == "cuda" else []):
        key, _, value = arg[2:].partition("=")
        defines += ["-C", f"cmake.define.{key}={value}"]
    say(f"building {backend} engine (patch set {set_id}) in {build_dir.relative_to(ROOT)}; "
        f"a fresh build takes minutes")
    action = (["wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir", "-w", str(wheel_dir)] if wheel_dir
              else ["install", "--no-deps", "--no-build-isolation", "--force-reinstall", "--no-cache-dir"])
    cmd = [
        sys.executable, "-m", "pip", *action,
        "-C", f"build-dir={build_dir}",
        "-C", "cmake.build-type=Release",
        *defines,
        str(tree),
    ]
    res = subprocess.run(cmd, env=env, stdout=sys.stderr)
    if res.returncode != 0:
        die("pip install of the patched engine failed (see the log above)")
    if wheel_dir:
        wheels = sorted(wheel_dir.glob("llama_cpp_python-*.whl"), key=lambda w: w.stat().st_mtime)
        engine = wheel_dir / f"llama-cpp-python-{backend}-engine.tar.xz"
        engine_tarball(wheels[-1], engine)
        say(f"wheel written to {wheels[-1]}, and the package alone to {engine} ({engine.stat().st_size / 1e6:.1f} MB)")
        return
    # the package was installed without resolving its dependencies (so pip never rebuilds or
    # replaces anything else); install them from its metadata now
    requires = [line.split(":", 1)[1].strip() for line in (tree / "PKG-INFO").read_text().splitlines()
                if line.startswith("Requires-Dist:") and "extra ==" not in line]
    if requires:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", *requires], check=True, stdout=sys.stderr)


def engine_tarball(wheel: Path, out: Path) -> None:
    """The engine package of `wheel` (llama_cpp/ and its dist-info) as a tar.xz to unpack into a
    site-packages: a wheel stores each library's SONAME links as copies (three of a 60 MB
    libggml-cuda), the tarball stores them as links, which the device tool's size limit needs."""
    import tempfile
    import zipfile

    with tempfile.TemporaryDirectory(prefix="kvlocal-engine-") as tmp:
        with zipfile.ZipFile(wheel) as z:
            members = [n for n in z.namelist() if n.startswith(("llama_cpp/", "llama_cpp_python-"))]
            z.extractall(tmp, members)
        lib = Path(tmp) / "llama_cpp" / "lib"
        for real in sorted(lib.glob("lib*.so.*.*.*")):  # libggml-cuda.so.0.25.3: the file; .so.0 and .so link to it
            stem = real.name.split(".so.")[0]
            major = real.name.split(".so.")[1].split(".")[0]
            for link, target in ((f"{stem}.so.{major}", real.name), (f"{stem}.so", f"{stem}.so.{major}")):
                (lib / link).unlink(missing_ok=True)
                (lib / link).symlink_to(target)
        tmp_out = out.with_name(out.name + ".tmp")
        with tarfile.open(tmp_out, "w:xz") as tar:
            for top in sorted(p.name for p in Path(tmp).iterdir()):
                tar.add(Path(tmp) / top, arcname=top)
        os.replace(tmp_out, out)


def build_backend_ops_tests(tree: Path, jobs: int, set_id: str) -> Path:
    """Compile llama.cpp's test-backend-ops (it needs only ggml) against the installed engine."""
    del jobs, set_id
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        die("install the engine first (python vendor/build_engine.py)")
    lib_dir = Path(spec.origin).parent / "lib"
    llama_dir = tree / "vendor" / "llama.cpp"
    binary = BUILD / "tests-cpu" / "test-backend-ops"
    binary.parent.mkdir(parents=True, exist_ok=True)
    source = llama_dir / "tests" / "test-backend-ops.cpp"
    if binary.exists() and binary.stat().st_mtime > max(source.stat().st_mtime, (lib_dir / "libggml-base.so").stat().st_mtime):
        say(f"{binary.relative_to(ROOT)} is up to date")
        return binary
    say("compiling test-backend-ops (about a minute)")
    cmd = [os.environ.get("CXX", "c++"), "-std=c++17", "-O2", "-pthread",
           f"-I{llama_dir / 'ggml' / 'include'}", str(source), "-o", str(binary),
           f"-L{lib_dir}", "-lggml", "-lggml-base", f"-Wl,-rpath,{lib_dir}"]
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    say(f"built {binary.relative_to(ROOT)}")
    return binary


# ggml-vulkan.cpp uses VK_EXT_layer_settings without a guard (vk::LayerSettingEXT): Vulkan-Headers
# 1.3.272 or newer. Debian 12 ships 1.3.239; its vulkan.hpp fails there after every shader has been
# compiled (minutes), so check first. Headers 1.4.309 (Debian 13's libvulkan-dev, unpacked anywhere,
# VULKAN_SDK=<that>/usr) work with Debian 12's loader, glslc and SPIRV-Headers.
VULKAN_MIN_HEADER = 272


def check_vulkan_headers() -> None:
    """Stop before the shader compilation when the Vulkan headers are too old for ggml-vulkan."""
    sdk = os.environ.get("VULKAN_SDK")
    for inc in ([Path(sdk) / "include"] if sdk else []) + [Path("/usr/include"), Path("/usr/local/include")]:
        core = inc / "vulkan" / "vulkan_core.h"
        if core.is_file():
            break
    else:
        say("no vulkan/vulkan_core.h found (apt-get install libvulkan-dev, or set VULKAN_SDK); CMake will say more")
        return
    text = core.read_text(errors="replace")
    patch = re.search(r"^#define VK_HEADER_VERSION (\d+)", text, re.M)
    complete = re.search(r"^#define VK_HEADER_VERSION_COMPLETE VK_MAKE_API_VERSION\(0, (\d+), (\d+),", text, re.M)
    version = (int(complete.group(1)), int(complete.group(2)), int(patch.group(1))) if patch and complete else (0, 0, 0)
    shown = ".".join(map(str, version))
    if version < (1, 3, VULKAN_MIN_HEADER):
        die(f"{core} is Vulkan-Headers {shown}; the Vulkan backend needs 1.3.{VULKAN_MIN_HEADER} or newer "
            f"(VK_EXT_layer_settings). Point VULKAN_SDK at newer headers (VULKAN_SDK/include/vulkan), e.g. "
            f"Debian 13's libvulkan-dev unpacked with dpkg-deb -x")
    say(f"Vulkan headers: {core} ({shown})")


def build_backend_ops_tests_vulkan(tree: Path, jobs: int, set_id: str) -> Path:
    """Configure the patched llama.cpp for Vulkan with CMake in its own directory,
    vendor/build/tests-vulkan, build only ggml there (CPU and Vulkan backends), and compile
    test-backend-ops against it: no installed engine is needed. Run it as
    vendor/build/tests-vulkan/bin/test-backend-ops test -b Vulkan0 -o OP.
    (ggml cannot be configured on its own from the sdist: it lacks ggml/ggml.pc.in.)"""
    bin_dir = Path(sys.executable).parent
    cmake = str(bin_dir / "cmake") if (bin_dir / "cmake").exists() else shutil.which("cmake")
    ninja = str(bin_dir / "ninja") if (bin_dir / "ninja").exists() else shutil.which("ninja")
    if not cmake or not ninja:
        die("cmake and ninja are required (pip install cmake ninja)")
    llama_dir = tree / "vendor" / "llama.cpp"
    # one build directory per source tree, as install() keeps them
    build_dir = BUILD / ("tests-vulkan" if tree.parent == SRC and tree.name.startswith("llama_cpp_python-")
                         else "tests-vulkan-pack")
    out_dir = build_dir / "bin"
    if not (build_dir / "build.ninja").exists():
        check_vulkan_headers()
        say(f"configuring llama.cpp for Vulkan in {build_dir.relative_to(ROOT)}")
        configure = [
            cmake, "-S", str(llama_dir), "-B", str(build_dir), "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}",
            "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
            *[a for a in cmake_args("vulkan", None, set_id) if not a.startswith("-DLLAVA")],
        ]
        if subprocess.run(configure, stdout=sys.stderr).returncode != 0:
            die("CMake could not configure ggml for Vulkan: it needs the Vulkan headers and loader, glslc "
                "and SPIRV-Headers (Debian: apt-get install libvulkan-dev glslc spirv-headers)")
    say(f"building ggml with the Vulkan backend ({jobs} jobs; a fresh build compiles every shader: long)")
    if subprocess.run([ninja, "-C", str(build_dir), "-j", str(jobs), "ggml"], stdout=sys.stderr).returncode != 0:
        die("the Vulkan build of ggml failed (see the log above)")
    binary = out_dir / "test-backend-ops"
    source = llama_dir / "tests" / "test-backend-ops.cpp"
    newest = max(source.stat().st_mtime, *(p.stat().st_mtime for p in out_dir.glob("libggml*.so")))
    if binary.exists() and binary.stat().st_mtime > newest:
        say(f"{binary.relative_to(ROOT)} is up to date")
        return binary
    say("compiling test-backend-ops (about a minute)")
    cmd = [os.environ.get("CXX", "c++"), "-std=c++17", "-O2", "-pthread",
           f"-I{llama_dir / 'ggml' / 'include'}", str(source), "-o", str(binary),
           f"-L{out_dir}", "-lggml", "-lggml-base", f"-Wl,-rpath,{out_dir}"]
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    say(f"built {binary.relative_to(ROOT)}")
    return binary


# What the routed decode graph needs from the CUDA backend: its dispatcher (supports_op, graph
# compute) and the kernels of the ops the graph uses, plus the patched ggml and llama sources.
CUDA_CHECK_SOURCES = (
    "ggml-cuda.cu", "getrows.cu", "set-rows.cu", "top-k.cu", "argsort.cu", "concat.cu", "pool2d.cu",
    "fattn.cu", "cpy.cu", "binbcast.cu", "scale.cu", "rope.cu", "norm.cu", "mmvf.cu", "mmvq.cu",
)


def compile_check(tree: Path, backend: str, cuda_arch: str | None, jobs: int, set_id: str) -> None:
    """Configure the patched llama.cpp for CUDA and compile only the objects the routed graph
    depends on (no link, no install): a check that needs the CUDA compiler, not a GPU."""
    if backend != "cuda":
        die("--compile-check is for --backend cuda (a Metal build needs macOS)")
    bin_dir = Path(sys.executable).parent
    cmake = str(bin_dir / "cmake") if (bin_dir / "cmake").exists() else shutil.which("cmake")
    ninja = str(bin_dir / "ninja") if (bin_dir / "ninja").exists() else shutil.which("ninja")
    if not cmake or not ninja:
        die("cmake and ninja are required (pip install cmake ninja)")
    llama_dir = tree / "vendor" / "llama.cpp"
    build_dir = BUILD / "cuda-check"
    say(f"configuring llama.cpp for CUDA (arch {cuda_arch or 'native'}) in {build_dir.relative_to(ROOT)}")
    configure = [
        cmake, "-S", str(llama_dir), "-B", str(build_dir), "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}",
        "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
        *[a for a in cmake_args(backend, cuda_arch, set_id) if not a.startswith("-DLLAVA")],
    ]
    configure += cuda_toolkit_args()
    if subprocess.run(configure, stdout=sys.stderr).returncode != 0:
        die("CMake could not configure the CUDA build: it needs the CUDA toolkit with cuBLAS and the driver "
            "library or its stub (lib64/stubs/libcuda.so); CUDAToolkit_ROOT points CMake at a toolkit")
    listed = subprocess.run([ninja, "-C", str(build_dir), "-t", "targets", "all"], check=True,
                            capture_output=True, text=True).stdout
    outputs = {line.split(":")[0] for line in listed.splitlines()}
    wanted = [f"ggml/src/ggml-cuda/CMakeFiles/ggml-cuda.dir/{name}.o" for name in CUDA_CHECK_SOURCES]
    wanted += ["ggml/src/CMakeFiles/ggml-base.dir/ggml.c.o", "src/CMakeFiles/llama.dir/llama-graph.cpp.o",
               "src/CMakeFiles/llama.dir/llama-kv-cache.cpp.o", "src/CMakeFiles/llama.dir/llama-context.cpp.o"]
    missing = [w for w in wanted if w not in outputs]
    if missing:
        die(f"the CUDA build has no such objects: {', '.join(missing)}")
    say(f"compiling {len(wanted)} objects with nvcc and the host compiler")
    if subprocess.run([ninja, "-C", str(build_dir), "-j", str(jobs), *wanted], stdout=sys.stderr).returncode != 0:
        die("the CUDA compile check failed (see the log above)")
    say(f"CUDA compile check passed: {len(wanted)} objects of patch set {set_id} for arch {cuda_arch or 'native'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["cpu", "cuda", "metal", "vulkan"], default="cpu")
    parser.add_argument("--cuda-arch", default=None, help="CMAKE_CUDA_ARCHITECTURES (default: native)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--tests", action="store_true",
                        help="also build test-backend-ops (CPU; with --backend vulkan: Vulkan)")
    parser.add_argument("--tests-only", action="store_true",
                        help="only build test-backend-ops (CPU; with --backend vulkan: ggml with Vulkan "
                             "and test-backend-ops in vendor/build/tests-vulkan)")
    parser.add_argument("--prepare-only", action="store_true", help="fetch, verify and patch; do not build")
    parser.add_argument("--print-id", action="store_true", help="print the patch-set id and exit")
    parser.add_argument("--compile-check", action="store_true",
                        help="with --backend cuda: configure and compile the objects the routed graph needs "
                             "(no GPU needed, no install)")
    parser.add_argument("--make-pack", type=Path, metavar="FILE",
                        help="write the patched source, trimmed to what a build reads, as FILE (.tar.gz) for a "
                             "machine without the package registry, and exit")
    parser.add_argument("--wheel", type=Path, metavar="DIR",
                        help="write the built engine as a wheel into DIR instead of installing it (e.g. a CUDA "
                             "engine built here for a GPU machine that should not spend its time compiling)")
    parser.add_argument("--from-pack", type=Path, metavar="FILE",
                        help="build from such a pack instead of the registry's sdist (its patch set must match)")
    args = parser.parse_args()
    if args.make_pack and args.from_pack:
        parser.error("--make-pack and --from-pack exclude each other")

    if args.print_id:
        print(patchset_id(patch_files()))
        return
    for tool in () if args.from_pack else ("patch",):
        if shutil.which(tool) is None:
            die(f"'{tool}' is required (apt-get install {tool})")
    pin = read_pin()
    if args.make_pack:
        # from a fresh copy of the verified sdist, so that nothing but patches/ reaches the pack
        import tempfile

        sdist = fetch_sdist(pin)
        with tempfile.TemporaryDirectory(prefix="kvlocal-pack-") as tmp:
            with tarfile.open(sdist) as tar:
                tar.extractall(tmp, filter="data")
            tree = Path(tmp) / f"llama_cpp_python-{pin['version']}"
            pack_make(tree, pin, apply_patches(tree), args.make_pack.resolve())
        return
    if args.from_pack:
        tree, set_id = pack_unpack(args.from_pack.resolve())
    else:
        tree = unpack(fetch_sdist(pin), pin)
        set_id = apply_patches(tree)
    if args.prepare_only:
        say(f"patched tree ready: {tree}")
        return
    if args.tests_only:
        if args.backend == "vulkan":
            build_backend_ops_tests_vulkan(tree, args.jobs, set_id)
            return
        build_backend_ops_tests(tree, args.jobs, set_id)
        return
    if args.compile_check:
        compile_check(tree, args.backend, args.cuda_arch, args.jobs, set_id)
        return
    install(tree, args.backend, args.cuda_arch, args.jobs, set_id, args.wheel.resolve() if args.wheel else None)
    if args.wheel:
        return
    if args.tests:
        if args.backend == "vulkan":
            build_backend_ops_tests_vulkan(tree, args.jobs, set_id)
        else:
            build_backend_ops_tests(tree, args.jobs, set_id)
    say(f"done: engine with patch set {set_id}")


if __name__ == "__main__":
    main()
