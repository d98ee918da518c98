"""`vitctl image build`: containers/Containerfile built by buildah, then written as an OCI archive and as the squashfs
that pyxis runs (`srun --container-image=/path/NAME.sqsh`), laid out as `enroot import` lays out its images."""

import gzip
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vitctl.datasets.oserrors import file_in_the_way, what_it_is, write_refusal

from .errors import LaunchError
from .provenance import git_commit, vitctl_version

REPO = Path(__file__).resolve().parents[1]
CONTAINERFILE = Path("containers/Containerfile")
VENDOR = Path("containers/vendor")  # ignored by git: third-party archives staged for an offline build
DEFAULT_BASE = "nvcr.io/nvidia/pytorch:25.10-py3"
DEFAULT_ARCHS = "8.0;9.0;10.0"
DEFAULT_BASE_CUDA, DEFAULT_BASE_OLDEST_ARCH = "13.0", 75  # CUDA 13's nvcc dropped Maxwell, Pascal and Volta
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
# enroot keeps what its images need to start in /etc; zstd unpacks fast and squashfs-tools has had it for years.
SQUASH_OPTIONS = ("-comp", "zstd", "-Xcompression-level", "3", "-wildcards", "-e", "dev/*")


# An image reference as buildah parses it: lowercase path components, an optional tag, and first an optional registry
# host (localhost, a dotted name, or a name with a port: any other first component is a path component)
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_HOST = r"(?:localhost|[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+|[A-Za-z0-9-]+(?=:\d))(?::\d+)?"
IMAGE_REFERENCE = re.compile(rf"(?:{_HOST}/)?{_COMPONENT}(?:/{_COMPONENT})*(?::\w[\w.-]{{0,127}})?")


def tag_problem(tag: str) -> str | None:
    """Why buildah would refuse `tag` as an image name (after the base image's pull and minutes of build), or None."""
    if IMAGE_REFERENCE.fullmatch(tag):
        return None
    return (f"{tag!r} is not an image name: lowercase name components (letters, digits, . _ -) separated by /, a "
            "registry host first if any, a :tag last if any, e.g. localhost/vitctl:0.1.0")


# What buildah's FROM takes besides a reference: one pinned by digest, or one named with its transport
_DIGEST = r"@sha256:[0-9a-f]{64}"
_TRANSPORT = r"(?:docker|docker-archive|docker-daemon|oci|oci-archive|containers-storage|dir):\S+"
BASE_REFERENCE = re.compile(rf"{_TRANSPORT}|{IMAGE_REFERENCE.pattern}(?:{_DIGEST})?")


def base_problem(base: str) -> str | None:
    """Why buildah would refuse `base` as the image to build on (after it started), or None."""
    if BASE_REFERENCE.fullmatch(base):
        return None
    what = "is empty (an unset shell variable?)" if not base.strip() else "is not an image reference"
    return (f"{base!r} {what}: give the image with torch and nvcc to build on, lowercase name components "
            f"separated by /, a registry host first if any, a :tag or @sha256:digest last, e.g. {DEFAULT_BASE}, or "
            "localhost/vitctl-base:torch2.11.0 (containers/base/build-base)")


def arch_list_problem(arch_list: str) -> str | None:
    """Why torch would refuse `arch_list` as TORCH_CUDA_ARCH_LIST when the build compiles the ops (minutes into the
    build), or None."""
    # torch reads spaces as ';' and expands names (Ampere: 8.0;8.6+PTX) within an entry: each entry stands alone
    bad = list(dict.fromkeys(e for e in re.split("[ ;]", arch_list) if not _torch_compiles_for(e)))
    if not bad:
        return None
    named = ", ".join("an empty entry (two separators in a row, or one at an end)" if not e else repr(e) for e in bad)
    return (f"{arch_list!r}: {named} {'is' if len(bad) == 1 else 'are'} not a CUDA arch torch compiles for; "
            "TORCH_CUDA_ARCH_LIST is entries such as 8.0, 9.0, 9.0a, 10.0 or 8.6+PTX (or names: Ampere, Hopper, "
            f"Blackwell) separated by ; or spaces, e.g. --arch-list '{DEFAULT_ARCHS}'")


def _torch_compiles_for(entry: str) -> bool:
    """Whether torch's extension build takes `entry` alone as TORCH_CUDA_ARCH_LIST."""
    if entry in ("", "native"):  # torch reads both as "the GPUs here", and the build sees none
        return False
    return _arch_flags(entry) is not None


def _below(arch_list: str, oldest: int) -> list[str]:
    """The entries of a valid `arch_list` for which torch would compile a compute capability older than `oldest` (75:
    7.5), each as written (names such as Pascal included)."""
    return [repr(entry) for entry in dict.fromkeys(re.split("[ ;]", arch_list))
            if any(int(cc) < oldest for cc in re.findall(r"compute_(\d+)", " ".join(_arch_flags(entry) or [])))]


def _arch_flags(entry: str) -> list[str] | None:
    """nvcc's -gencode flags torch's extension build derives from `entry` as TORCH_CUDA_ARCH_LIST; None if it refuses
    it."""
    # its import warns when this machine has no CUDA runtime, which the check does not need
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    from torch.utils import cpp_extension

    with _environment("TORCH_CUDA_ARCH_LIST", entry):
        try:
            return cpp_extension._get_cuda_arch_flags()
        except ValueError:
            return None


@contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    """The environment variable `name` set to `value` within the block, as it was after it."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            del os.environ[name]
        else:
            os.environ[name] = previous


@dataclass(frozen=True)
class ImageRequest:
    base: str = DEFAULT_BASE
    tag: str = "localhost/vitctl:latest"
    out: Path = Path("build/image")
    arch_list: str = DEFAULT_ARCHS
    apex_archive: Path | None = None  # apex's source as an archive (offline); None: the Containerfile's APEX_REF
    max_jobs: int | None = None  # parallel compiler jobs (nvcc takes GBs of memory each)
    storage_driver: str = "vfs"  # works everywhere, as root, without fuse or overlay support
    storage_root: Path | None = None  # buildah's own image store instead of the system's


@dataclass(frozen=True)
class ImageOutputs:
    oci_archive: Path
    squashfs: Path


@dataclass(frozen=True)
class BuiltImage:
    outputs: ImageOutputs
    seconds: float
    oci_bytes: int
    squashfs_bytes: int


def outputs(request: ImageRequest) -> ImageOutputs:
    """localhost/vitctl:0.1.0 -> OUT/vitctl-0.1.0.oci.tar and OUT/vitctl-0.1.0.sqsh."""
    name = request.tag.rsplit("/", 1)[-1].replace(":", "-")
    out = request.out.absolute()
    return ImageOutputs(out / f"{name}.oci.tar", out / f"{name}.sqsh")


def buildah(request: ImageRequest) -> list[str]:
    root = ["--root", str(request.storage_root), "--runroot", str(request.storage_root / "run")] \
        if request.storage_root else []
    return ["buildah", "--storage-driver", request.storage_driver, *root]


def bud_command(request: ImageRequest, version: str, commit: str | None) -> list[str]:
    """The build, run in the repository root (the build context)."""
    args = {"BASE_IMAGE": request.base, "TORCH_CUDA_ARCH_LIST": request.arch_list, "VITCTL_VERSION": version,
            "GIT_COMMIT": commit or "unknown"}
    if request.apex_archive:
        args["APEX_ARCHIVE"] = str(VENDOR / request.apex_archive.name)
    if request.max_jobs:
        args["MAX_JOBS"] = str(request.max_jobs)
    volumes = []
    if HOST_CA.is_file():  # pip in the build trusts what this machine trusts (a TLS-inspecting proxy's CA)
        volumes = ["--volume", f"{HOST_CA}:/run/host-ca.crt:ro"]
        args["PIP_CERT"] = "/run/host-ca.crt"
    return [*buildah(request), "bud", "--isolation", "chroot", "-f", str(CONTAINERFILE), "-t", request.tag, *volumes,
            *(a for key, value in args.items() for a in ("--build-arg", f"{key}={value}")), "."]


def partial(path: Path) -> Path:
    """Where `path` is written until it is complete: an interrupted build leaves nothing that looks finished."""
    return path.with_name(path.name + ".partial")


def push_command(request: ImageRequest, target: Path) -> list[str]:
    return [*buildah(request), "push", request.tag, f"oci-archive:{target}:{request.tag}"]


def squash_command(rootfs: Path, target: Path) -> list[str]:
    return ["mksquashfs", str(rootfs), str(target), "-all-root", "-noappend", "-no-progress", *SQUASH_OPTIONS]


def uncommitted_warning() -> str | None:
    """Why an image of this checkout would not be the commit: the build copies its uncommitted changes too."""
    commit = git_commit()
    if commit is None or "-dirty-" not in commit:
        return None
    return (f"the checkout holds uncommitted changes, which the image holds too: it is labelled {commit[:12]}"
            f"{commit[40:]}, and its ranks refuse jobs submitted from any other state of the checkout (`git status` "
            "lists the changes; commit them first for an image that a commit names)")


def plan(request: ImageRequest) -> list[str]:
    """The build as shell lines (`--dry-run`)."""
    staged = [] if not request.apex_archive else [shlex.join(["cp", str(request.apex_archive), str(VENDOR) + "/"])]
    ctr, tool, done = "$container", shlex.join(buildah(request)), outputs(request)
    return [f"cd {shlex.quote(str(REPO))}", *staged, shlex.join(bud_command(request, vitctl_version(), git_commit())),
            shlex.join(push_command(request, partial(done.oci_archive))),
            f"container=$({tool} from --pull-never {shlex.quote(request.tag)})",
            f"rootfs=$({tool} mount {ctr})",
            "# as `enroot import`: /etc/environment (Env), /etc/fstab (Volumes), /etc/rc (labels, workdir, entrypoint, "
            "cmd) and /etc/rc.local from the image's config",
            f"{shlex.quote(sys.executable)} -c {shlex.quote(CONFIGURE)} \"$rootfs\" "
            f"\"$({tool} inspect --type image {shlex.quote(request.tag)})\"",
            shlex.join(squash_command(Path("ROOTFS"), partial(done.squashfs))).replace("ROOTFS", '"$rootfs"'),
            f"{tool} umount {ctr}; {tool} rm {ctr}",
            shlex.join(["mv", str(partial(done.oci_archive)), str(done.oci_archive)]),
            shlex.join(["mv", str(partial(done.squashfs)), str(done.squashfs)])]


# enroot_configure as the dry run prints it: python3 -c CONFIGURE ROOTFS "$(buildah inspect --type image TAG)"
CONFIGURE = ("import json, sys; from pathlib import Path; from vitctl.workflows.image import enroot_configure; "
             'enroot_configure(Path(sys.argv[1]), json.loads(sys.argv[2])["OCIv1"].get("config") or {})')


def enroot_configure(rootfs: Path, config: dict[str, Any]) -> None:
    """Write what enroot reads when a container starts from the OCI image config (`enroot import` does the same):
    the environment (pyxis's ranks find the image's python3 through its PATH), volumes as mounts, and /etc/rc."""
    etc = rootfs / "etc"
    etc.mkdir(parents=True, exist_ok=True)
    (etc / "environment").write_text("".join(f"{e}\n" for e in config.get("Env") or []))
    (etc / "fstab").write_text("".join(f"${{ENROOT_ROOTFS}}{v} {v} none x-create=dir,bind,rw,nosuid,nodev\n"
                                       for v in config.get("Volumes") or {}))
    workdir = config.get("WorkingDir") or "/"
    (rootfs / workdir.lstrip("/")).mkdir(parents=True, exist_ok=True)
    entrypoint = [shlex.quote(a) for a in config.get("Entrypoint") or []]
    cmd = [shlex.quote(a) for a in config.get("Cmd") or []] or ([] if entrypoint else ["/bin/sh"])
    labels = [f"# {key} {value}" for key, value in (config.get("Labels") or {}).items()]
    rc = [*labels, *([""] if labels else []),
          f"mkdir -p {shlex.quote(workdir)} 2> /dev/null", f"cd {shlex.quote(workdir)} && unset OLDPWD || exit 1", "",
          "if [ -s /etc/rc.local ]; then", "    . /etc/rc.local", "fi", "",
          "if [ $# -gt 0 ]; then", "    exec " + " ".join([*entrypoint, '"$@"']),
          "else", "    exec " + " ".join([*entrypoint, *cmd]), "fi"]
    (etc / "rc").write_text("\n".join(rc) + "\n")
    (etc / "rc.local").write_text("# Sourced by /etc/rc when the container starts.\n")


def _run(command: list[str], what: str, cwd: Path | None = None) -> str:
    try:
        done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    except OSError as e:
        raise LaunchError(f"{what}: cannot run {command[0]} ({e.strerror}); install it: apt-get install buildah "
                          "squashfs-tools (or run `make image`, which does)") from None
    if done.returncode:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-25:])
        raise LaunchError(f"{what} failed (exit status {done.returncode}): {shlex.join(command)}\n{tail}")
    return done.stdout


def export_squashfs(request: ImageRequest, target: Path) -> None:
    """The image's root filesystem, configured as enroot would, into `target` (a temporary name: `build` renames it)."""
    tool = buildah(request)
    container = _run([*tool, "from", "--pull-never", request.tag], "creating a container of the image").strip()
    try:
        rootfs = Path(_run([*tool, "mount", container], "mounting the image").strip())
        inspected = json.loads(_run([*tool, "inspect", "--type", "image", request.tag], "reading the image config"))
        enroot_configure(rootfs, inspected["OCIv1"].get("config") or {})
        target.unlink(missing_ok=True)  # mksquashfs would append to a file left by an interrupted build
        _run(squash_command(rootfs, target), "mksquashfs")
    finally:
        subprocess.run([*tool, "umount", container], capture_output=True)
        subprocess.run([*tool, "rm", container], capture_output=True)


def check_tools() -> None:
    missing = [t for t in ("buildah", "mksquashfs") if shutil.which(t) is None]
    if missing:
        raise LaunchError(f"vitctl image build needs {' and '.join(missing)}: apt-get install buildah squashfs-tools "
                          "(as root; containers/README.md)")


def check_request(request: ImageRequest) -> None:
    """Refuse an --apex archive, an --out, or archs the default base cannot compile for, that the build would fail on
    only after minutes to an hour."""
    if request.base == DEFAULT_BASE and (old := _below(request.arch_list, DEFAULT_BASE_OLDEST_ARCH)):
        raise LaunchError(
            f"--arch-list {request.arch_list!r}: {', '.join(old)} {'is' if len(old) == 1 else 'are'} older than what "
            f"CUDA {DEFAULT_BASE_CUDA}, the default base's, compiles for (sm_{DEFAULT_BASE_OLDEST_ARCH} and newer); "
            f"leave {'it' if len(old) == 1 else 'them'} out (e.g. --arch-list '{DEFAULT_ARCHS}'); GPUs older than "
            f"sm_{DEFAULT_BASE_OLDEST_ARCH} need a base whose torch and nvcc are CUDA 12 (--base IMAGE)")
    if request.apex_archive and (problem := apex_archive_problem(request.apex_archive)):
        raise LaunchError(f"--apex {problem}")
    out = request.out.absolute()
    if blocker := file_in_the_way(out):
        raise LaunchError(f"--out {request.out}: {what_it_is(blocker)}, not a folder; move it away or choose another "
                          "--out")
    if refusal := write_refusal(out / "NAME.oci.tar"):
        raise LaunchError(f"--out {request.out}: {refusal}; choose another --out")


def apex_archive_problem(archive: Path) -> str | None:
    """Why the build would fail on `archive` (it unpacks it with `tar -xzf --strip-components=1` and runs the setup.py
    it finds on top): no gzip-compressed tar, one cut short, or no setup.py one folder down; or None."""
    ref = re.search(r"^ARG APEX_REF=(\w+)", (REPO / CONTAINERFILE).read_text(), re.MULTILINE)[1]
    fix = (f"pass apex's source as GitHub archives it, one folder holding setup.py (e.g. "
           f"https://github.com/NVIDIA/apex/archive/{ref}.tar.gz, or tar -czf apex.tar.gz apex/)")
    if not archive.is_file():
        return f"{archive}: no such file (an archive of apex's source, e.g. apex-{ref[:12]}.tar.gz)"
    try:
        with gzip.open(archive) as stream, tarfile.open(fileobj=stream, mode="r:") as tar:
            tops = [m for m in tar if m.isfile() and [p for p in m.name.split("/") if p][1:] == ["setup.py"]]
            stream.read()  # to the end of the gzip stream: a copy cut short after the last member is found too
    except (OSError, EOFError, tarfile.TarError, zlib.error) as e:
        return f"{archive}: not a gzip-compressed tar, which the build unpacks with tar -xzf ({e}); {fix}"
    if not tops:
        return (f"{archive}: holds no setup.py one folder down (FOLDER/setup.py), where the build looks for apex's "
                f"after unpacking it with tar --strip-components=1; {fix}")
    return None


def build(request: ImageRequest, echo: Callable[[str], None]) -> BuiltImage:
    """Build the image, write the OCI archive and the squashfs; the archive of apex is staged in the build context
    only while the build runs."""
    check_request(request)
    check_tools()
    if warning := uncommitted_warning():
        echo(f"warning: {warning}")
    done = outputs(request)
    done.oci_archive.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    staged = REPO / VENDOR / request.apex_archive.name if request.apex_archive else None
    try:
        if staged:
            staged.parent.mkdir(exist_ok=True)
            shutil.copyfile(request.apex_archive, staged)
        echo(f"building {request.tag} on {request.base} (CUDA archs {request.arch_list})")
        _run(bud_command(request, vitctl_version(), git_commit()), "buildah bud", cwd=REPO)
    finally:
        if staged:
            staged.unlink(missing_ok=True)
    oci_archive, squashfs = partial(done.oci_archive), partial(done.squashfs)
    try:
        echo(f"writing {done.oci_archive}")
        oci_archive.unlink(missing_ok=True)
        _run(push_command(request, oci_archive), "buildah push (OCI archive)")
        echo(f"writing {done.squashfs}")
        export_squashfs(request, squashfs)
    except BaseException:
        oci_archive.unlink(missing_ok=True)
        squashfs.unlink(missing_ok=True)
        raise
    # renamed together once both are written: a build that fails leaves the last build's pair as it was
    oci_archive.replace(done.oci_archive)
    squashfs.replace(done.squashfs)
    return BuiltImage(done, time.monotonic() - started, done.oci_archive.stat().st_size, done.squashfs.stat().st_size)
