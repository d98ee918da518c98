"""The container path that runs fast on a CPU machine: the image build against a stub base (real buildah, the real
Containerfile, a busybox base whose python3, pip and vitctl only record their arguments), its OCI archive and enroot
squashfs, the launch flags for pyxis, the version check at rank start and the no-JIT rule. The full image is built and
tested by `make image image-test` (containers/README.md)."""

import errno
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from conftest import ok, vitctl
from vitctl.trainer.ops import cuda
from vitctl.workflows import image, provenance
from vitctl.workflows.errors import LaunchError
from vitctl.workflows.job import TrainJob
from vitctl.workflows.provenance import IMAGE_COMMIT_ENV, vitctl_version

needs_tools = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(t) for t in ("buildah", "mksquashfs", "unsquashfs", "busybox")),
    reason="needs root, buildah, squashfs-tools and busybox-static (containers/install-tools, which `make test` runs)")

# The stub base's commands: each appends its arguments to /stub.log. In the ops stage, pip wheel and bdist_wheel write
# a "wheel" holding their arguments and environment, which the final stage's pip install copies into its log.
STUB = r"""#!/bin/sh
echo "$(basename "$0") $*" >> /stub.log
case "$*" in
  *"pip wheel"*) mkdir -p /wheels && echo "vitctl: $* TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST" \
      > /wheels/vitctl-0.1.0-cp311-cp311-linux_x86_64.whl ;;
  *bdist_wheel*) echo "apex: $* APEX_CUDA_EXT=$APEX_CUDA_EXT from $(cat setup.py)" \
      > /wheels/apex-0.1-cp311-cp311-linux_x86_64.whl ;;
  *"pip install"*--no-deps*) cat /wheels/*.whl >> /stub.log ;;
  *torch.version.cuda*) echo 13 ;;
  *torchvision*) echo torch==2.11.0; echo torchvision==0.26.0 ;;
  *requires*) echo click>=8.1 ;;
esac
"""


def _stub_base(storage: Path, tmp: Path) -> str:
    """A busybox image whose python3 and vitctl are the stub above, committed to `storage` as localhost/stub-base."""
    rootfs = tmp / "stub-rootfs"
    (rootfs / "bin").mkdir(parents=True)
    shutil.copy(shutil.which("busybox"), rootfs / "bin/busybox")
    for applet in ("sh", "mkdir", "tar", "gzip", "rm", "touch", "cat", "basename", "test"):
        (rootfs / "bin" / applet).symlink_to("busybox")
    for command in ("python3", "vitctl"):
        (rootfs / "bin" / command).write_text(STUB)
        (rootfs / "bin" / command).chmod(0o755)
    (rootfs / "tmp").mkdir()
    tool = ["buildah", "--storage-driver", "vfs", "--root", str(storage), "--runroot", str(storage / "run")]
    ctr = subprocess.run([*tool, "from", "scratch"], check=True, capture_output=True, text=True).stdout.strip()
    subprocess.run([*tool, "copy", ctr, f"{rootfs}/", "/"], check=True, capture_output=True)
    subprocess.run([*tool, "config", "--env", "PATH=/bin", ctr], check=True, capture_output=True)
    subprocess.run([*tool, "commit", "--rm", ctr, "localhost/stub-base"], check=True, capture_output=True)
    return "localhost/stub-base"


def _apex_archive(tmp: Path) -> Path:
    source = tmp / "apex"
    source.mkdir()
    (source / "setup.py").write_text("# stands for apex's\n")
    archive = tmp / "apex-test.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(source, arcname="apex")
    return archive


@needs_tools
def test_image_builds_on_a_stub_base_into_an_oci_archive_and_an_enroot_squashfs(tmp_path):
    storage = tmp_path / "storage"
    request = image.ImageRequest(_stub_base(storage, tmp_path), "localhost/vitctl-ci:test", tmp_path / "out", "9.0",
                                 _apex_archive(tmp_path), storage_root=storage)
    try:
        built = image.build(request, lambda text: None)
        before = {p.name: p.read_bytes() for p in request.out.iterdir()}
        # a rebuild whose squashfs fails (a full disk) keeps the last build's pair: was a new .oci.tar beside the
        # old .sqsh, which `train --container-image` then ran
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(image, "squash_command", lambda rootfs, target: ["sh", "-c", "exit 1"])
            with pytest.raises(LaunchError, match="mksquashfs failed"):
                image.build(request, lambda text: None)
        assert {p.name: p.read_bytes() for p in request.out.iterdir()} == before
        tool = image.buildah(request)
        config = json.loads(subprocess.run([*tool, "inspect", "--type", "image", request.tag], check=True,
                                           capture_output=True, text=True).stdout)["OCIv1"]["config"]
        log = subprocess.run(["unsquashfs", "-cat", built.outputs.squashfs, "stub.log"], check=True,
                             capture_output=True, text=True).stdout
        environment = subprocess.run(["unsquashfs", "-cat", built.outputs.squashfs, "etc/environment"], check=True,
                                     capture_output=True, text=True).stdout.splitlines()
    finally:
        subprocess.run([*image.buildah(request), "rmi", "--all", "--force"], capture_output=True)
        shutil.rmtree(storage, ignore_errors=True)
    assert config["Labels"]["org.opencontainers.image.version"] == vitctl_version()
    assert config["Labels"]["ai.vitctl.cuda-arch-list"] == "9.0"
    assert "VITCTL_PREBUILT_OPS=1" in config["Env"] and "VITCTL_PREBUILT_OPS=1" in environment
    assert not (image.REPO / image.VENDOR / "apex-test.tar.gz").exists()  # staged only while building
    steps = log.splitlines()
    assert "vitctl: -m pip wheel --no-deps --no-build-isolation -w /wheels ./vitctl TORCH_CUDA_ARCH_LIST=9.0" in steps
    apex = "apex: ../containers/apex_subset.py bdist_wheel --dist-dir /wheels APEX_CUDA_EXT=1"
    assert f"{apex} from # stands for apex's" in steps  # built from the staged archive
    install = next(s for s in steps if "nvidia-dali-cuda130" in s)  # DALI for torch's CUDA 13
    assert "-c /tmp/keep-torch.txt" in install and "webdataset" in install
    assert steps[-1].startswith("vitctl doctor --expect-image")  # the self-test ends the build
    assert built.oci_bytes > 0 and tarfile.is_tarfile(built.outputs.oci_archive)
    assert sorted(p.name for p in request.out.iterdir()) == ["vitctl-ci-test.oci.tar", "vitctl-ci-test.sqsh"]


def test_a_build_stopped_by_sigterm_removes_the_apex_archive_it_staged(tmp_path):
    """Before: exit 143 at once, the archive left in containers/vendor/, which every later build context copies."""
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("buildah", "mksquashfs"):  # a build that takes its time
        (tools / tool).write_text("#!/bin/sh\nexec sleep 60\n")
        (tools / tool).chmod(0o755)
    apex, staged = _apex_archive(tmp_path), image.REPO / image.VENDOR / "apex-test.tar.gz"
    build = subprocess.Popen([Path(sys.executable).parent / "vitctl", "image", "build", "--out", tmp_path / "img",
                              "--apex", apex], env={**os.environ, "PATH": f"{tools}:{os.environ['PATH']}"},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not staged.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert staged.exists()
        time.sleep(0.5)  # into the build
        build.send_signal(signal.SIGTERM)
        _, stderr = build.communicate(timeout=60)
        left = staged.exists()
    finally:
        build.kill()
        staged.unlink(missing_ok=True)
    assert build.returncode == 130 and stderr.strip().endswith("interrupted"), stderr
    assert not left


def test_the_dry_run_prints_the_enroot_configuration_as_a_command_that_runs(tmp_path):
    """Before: a comment stood for it, and the printed lines made a .sqsh without /etc/environment (the ranks' PATH)
    and /etc/rc."""
    lines = ok("image", "build", "--dry-run", "--tag", "localhost/vitctl:t", "--out", tmp_path / "img").output
    configure = next(line for line in lines.splitlines() if "enroot_configure" in line)
    config = {"OCIv1": {"config": {"Env": ["PATH=/opt/venv/bin:/usr/bin"], "WorkingDir": "/work"}}}
    rootfs = tmp_path / "rootfs"
    rootfs.mkdir()
    # buildah as a shell function: its inspect prints the image's config as buildah does
    script = f"buildah() {{ echo {shlex.quote(json.dumps(config))}; }}\nrootfs={shlex.quote(str(rootfs))}\n{configure}"
    subprocess.run(["bash", "-c", script], check=True)
    assert (rootfs / "etc/environment").read_text() == "PATH=/opt/venv/bin:/usr/bin\n"
    assert "cd /work && unset OLDPWD || exit 1" in (rootfs / "etc/rc").read_text()


@needs_tools
def test_enroot_layout_of_a_tiny_rootfs(tmp_path):
    rootfs = tmp_path / "rootfs"
    (rootfs / "dev").mkdir(parents=True)
    (rootfs / "dev/null").write_text("")  # enroot leaves /dev to the runtime
    config = {"Env": ["PATH=/opt/venv/bin:/usr/bin", "VITCTL_PREBUILT_OPS=1"], "Labels": {"org.opencontainers."
              "image.version": "0.1.0"}, "WorkingDir": "/work", "Cmd": ["python3", "-m", "vitctl.cli"],
              "Volumes": {"/data": {}}}
    image.enroot_configure(rootfs, config)
    target = tmp_path / "tiny.sqsh"
    subprocess.run(image.squash_command(rootfs, target), check=True, capture_output=True)
    listing = subprocess.run(["unsquashfs", "-l", target], check=True, capture_output=True, text=True).stdout
    cat = {name: subprocess.run(["unsquashfs", "-cat", target, name], check=True, capture_output=True,
                                text=True).stdout for name in ("etc/environment", "etc/rc", "etc/fstab")}
    assert cat["etc/environment"] == "PATH=/opt/venv/bin:/usr/bin\nVITCTL_PREBUILT_OPS=1\n"
    assert cat["etc/rc"].startswith("# org.opencontainers.image.version 0.1.0\n")
    assert "cd /work && unset OLDPWD || exit 1" in cat["etc/rc"]
    assert '    exec "$@"' in cat["etc/rc"] and "    exec python3 -m vitctl.cli" in cat["etc/rc"]
    assert cat["etc/fstab"] == "${ENROOT_ROOTFS}/data /data none x-create=dir,bind,rw,nosuid,nodev\n"
    assert "squashfs-root/dev/null" not in listing and "squashfs-root/work" in listing


def test_image_build_dry_run_prints_the_commands(tmp_path):
    apex = _apex_archive(tmp_path)
    out = ok("image", "build", "--dry-run", "--base", "localhost/vitctl-base:torch2.11.0", "--tag",
             "localhost/vitctl:ci", "--out", tmp_path / "img", "--arch-list", "9.0", "--apex", apex).output
    lines = out.splitlines()
    bud = next(line for line in lines if " bud " in line)
    for part in ["--isolation chroot", "-f containers/Containerfile",
                 "--build-arg BASE_IMAGE=localhost/vitctl-base:torch2.11.0", "--build-arg TORCH_CUDA_ARCH_LIST=9.0",
                 f"--build-arg VITCTL_VERSION={vitctl_version()}",
                 "--build-arg APEX_ARCHIVE=containers/vendor/apex-test.tar.gz"]:
        assert part in bud, part
    img = tmp_path / "img"  # each output written under a .partial name, both renamed once both are complete
    assert f"push localhost/vitctl:ci oci-archive:{img}/vitctl-ci.oci.tar.partial:localhost/vitctl:ci" in out
    assert f'mksquashfs "$rootfs" {img}/vitctl-ci.sqsh.partial -all-root' in out
    assert lines[-2:] == [f"mv {img}/vitctl-ci.oci.tar.partial {img}/vitctl-ci.oci.tar",
                          f"mv {img}/vitctl-ci.sqsh.partial {img}/vitctl-ci.sqsh"]
    assert not (tmp_path / "img").exists()


@pytest.mark.parametrize("tag", ["", "Vitctl:ci", "MyTeam/vitctl", "localhost/vitctl:", "vitctl:ci tag", "a//b"])
def test_a_tag_buildah_would_refuse_is_refused_before_the_build(tmp_path, tag):
    result = vitctl("image", "build", "--dry-run", "--tag", tag, "--out", tmp_path / "img")
    assert result.exit_code == 2 and f"{tag!r} is not an image name: lowercase name components" in result.stderr
    assert not (tmp_path / "img").exists()


@pytest.mark.parametrize("tag", ["vitctl", "localhost/vitctl:ci", "nvcr.io/nvidia/pytorch:25.10-py3",
                                 "registry.example.org:5000/team/vit_ctl:v1.2_rc-3", "gpuhost:5000/vitctl"])
def test_tags_buildah_takes_pass(tmp_path, tag):
    assert f" -t {tag} " in ok("image", "build", "--dry-run", "--tag", tag, "--out", tmp_path / "img").output


@pytest.mark.parametrize("base, what", [("", "is empty (an unset shell variable?)"),
                                        ("nvcr.io/nvidia/pytorch:25.10 py3", "is not an image reference"),
                                        ("nvcr.io/nvidia/PyTorch:25.10-py3", "is not an image reference")])
def test_a_base_buildah_would_refuse_is_refused_before_the_build(tmp_path, base, what):
    """Before, a dry run printed BASE_IMAGE= and a build started buildah, which failed with 'no FROM statement'."""
    result = vitctl("image", "build", "--dry-run", "--base", base, "--out", tmp_path / "img")
    assert result.exit_code == 2 and f"{base!r} {what}: give the image with torch and nvcc" in result.stderr
    assert "e.g. nvcr.io/nvidia/pytorch:25.10-py3" in result.stderr


@pytest.mark.parametrize("base", ["nvcr.io/nvidia/pytorch:25.10-py3", "localhost/vitctl-base:torch2.11.0",
                                  f"nvcr.io/nvidia/pytorch@sha256:{'a1' * 32}", "oci-archive:/images/base.oci.tar"])
def test_bases_buildah_takes_pass(tmp_path, base):
    assert f"BASE_IMAGE={base}" in ok("image", "build", "--dry-run", "--base", base, "--out", tmp_path / "img").output


@pytest.mark.parametrize("archs", ["foo", "9.0;bogus", "", "9,0", "9.0;;10.0", "native", "Ampere+PTX"])
def test_an_arch_list_torch_would_refuse_is_refused_before_the_build(tmp_path, archs):
    result = vitctl("image", "build", "--dry-run", "--arch-list", archs, "--out", tmp_path / "img")
    assert result.exit_code == 2 and "Traceback" not in result.stderr
    assert f"Invalid value for '--arch-list': {archs!r}: " in result.stderr
    assert "not a CUDA arch torch compiles for; TORCH_CUDA_ARCH_LIST is entries such as 8.0, 9.0, 9.0a, 10.0 or " \
           "8.6+PTX (or names: Ampere, Hopper, Blackwell) separated by ; or spaces, e.g. --arch-list '8.0;9.0;10.0'" \
           in " ".join(result.stderr.split())
    assert not (tmp_path / "img").exists()
    ok("image", "build", "--dry-run", "--arch-list", "8.0;9.0;10.0", "--out", tmp_path / "img")  # the example


@pytest.mark.parametrize("archs, old", [("7.0", "'7.0' is"), ("6.1;7.0;9.0", "'6.1', '7.0' are"),
                                         ("Pascal 9.0", "'Pascal' is")])
def test_archs_the_default_base_cannot_compile_for_are_refused_before_the_build(tmp_path, archs, old):
    """Before: accepted, and the default base's nvcc (CUDA 13) refused compute_70 in the build."""
    result = vitctl("image", "build", "--dry-run", "--arch-list", archs, "--out", tmp_path / "img")
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    assert f"error: --arch-list {archs!r}: {old} older than what CUDA 13.0, the default base's, compiles for (sm_75 " \
           "and newer)" in " ".join(result.stderr.split())
    fix = "8.0;9.0;10.0"
    assert f"e.g. --arch-list '{fix}'" in result.stderr
    ok("image", "build", "--dry-run", "--arch-list", fix, "--out", tmp_path / "img")  # the fix, followed
    other = ok("image", "build", "--dry-run", "--arch-list", archs, "--base", "localhost/vitctl-base:cu12",
               "--out", tmp_path / "img").output  # another base's nvcc is its own to judge
    assert shlex.join(["--build-arg", f"TORCH_CUDA_ARCH_LIST={archs}"]) in other


@pytest.mark.parametrize("archs", ["8.0;9.0;10.0", "9.0", "9.0a 10.0", "8.6+PTX;9.0", "Ampere Hopper", "12.0a"])
def test_arch_lists_torch_takes_pass(tmp_path, archs):
    bud = ok("image", "build", "--dry-run", "--arch-list", archs, "--out", tmp_path / "img").output
    assert shlex.join(["--build-arg", f"TORCH_CUDA_ARCH_LIST={archs}"]) in bud


def _tar_gz(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _bad_apex(kind: str, tmp: Path) -> tuple[Path, str]:
    """An --apex archive the build would fail on, and what the refusal says of it."""
    if kind == "text":
        return Path("/etc/passwd"), "not a gzip-compressed tar, which the build unpacks with tar -xzf (Not a gzipped"
    if kind == "empty":
        (tmp / "empty.tar.gz").touch()
        return tmp / "empty.tar.gz", "not a gzip-compressed tar, which the build unpacks with tar -xzf (empty file)"
    if kind == "plain tar":
        with tarfile.open(tmp / "apex.tar", "w") as tar:
            tar.add(_apex_archive(tmp), arcname="apex.tar.gz")
        return tmp / "apex.tar", "not a gzip-compressed tar"
    if kind == "cut short":
        whole = _tar_gz(tmp / "whole.tar.gz", {"apex/setup.py": b"#", "apex/csrc.cu": os.urandom(100_000)})
        (tmp / "cut.tar.gz").write_bytes(whole.read_bytes()[:60_000])
        return tmp / "cut.tar.gz", "(Compressed file ended before the end-of-stream marker was reached)"
    layout = {"setup.py on top": "setup.py", "setup.py two folders down": "NVIDIA/apex/setup.py"}[kind]
    return _tar_gz(tmp / "apex.tar.gz", {layout: b"#"}), "holds no setup.py one folder down (FOLDER/setup.py), where " \
        "the build looks for apex's after unpacking it with tar --strip-components=1"


@pytest.mark.parametrize("kind", ["text", "empty", "plain tar", "cut short", "setup.py on top",
                                  "setup.py two folders down"])
@pytest.mark.parametrize("dry_run", [True, False])
def test_an_apex_archive_the_build_cannot_unpack_is_refused_before_the_build(tmp_path, monkeypatch, kind, dry_run):
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))  # no buildah: nothing could be built
    archive, what = _bad_apex(kind, tmp_path)
    result = vitctl("image", "build", *(["--dry-run"] if dry_run else []), "--apex", archive, "--out", tmp_path / "img")
    assert result.exit_code == 2 and "Traceback" not in result.stderr  # a usage error, as --arch-list's and --base's
    message = " ".join(result.stderr.split())
    assert f"Error: Invalid value for '--apex': {archive}: " in message and what in message
    ref = re.search(r"ARG APEX_REF=(\w+)", (image.REPO / image.CONTAINERFILE).read_text())[1]
    assert message.endswith(f"; pass apex's source as GitHub archives it, one folder holding setup.py (e.g. "
                            f"https://github.com/NVIDIA/apex/archive/{ref}.tar.gz, or tar -czf apex.tar.gz apex/)")
    assert not (tmp_path / "img").exists() and not list((image.REPO / image.VENDOR).glob("*.tar*"))
    (tmp_path / "fixed").mkdir()
    fixed = _apex_archive(tmp_path / "fixed")  # the fix: one folder apex/ holding setup.py, as tar -czf packs it
    ok("image", "build", "--dry-run", "--apex", fixed, "--out", tmp_path / "img")


def test_an_out_that_cannot_be_written_is_refused_before_the_build(tmp_path, monkeypatch):
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    for out, blocker in [("notes.txt/img", "notes.txt is a file"), ("gone/img", "gone is a broken symbolic link")]:
        result = vitctl("image", "build", "--dry-run", "--out", tmp_path / out)
        assert result.exit_code == 1 and "Traceback" not in result.stderr
        assert result.stderr == f"error: --out {tmp_path / out}: {tmp_path / blocker}, not a folder; move it away " \
                                f"or choose another --out\n"
    def denied(*args, dir, **kwargs):  # as a user without write access meets it (root's access is never denied)
        raise PermissionError(errno.EACCES, "Permission denied", str(dir))

    with monkeypatch.context() as patch:
        patch.setattr("tempfile.TemporaryFile", denied)
        result = vitctl("image", "build", "--dry-run", "--out", tmp_path / "img")
    assert result.exit_code == 1
    assert result.stderr == f"error: --out {tmp_path / 'img'}: this user may not write in {tmp_path} (give this " \
                            f"user write access to {tmp_path}); choose another --out\n"
    assert (tmp_path / "notes.txt").read_text() == "mine" and not (tmp_path / "img").exists()
    ok("image", "build", "--dry-run", "--out", tmp_path / "img")
    frozen = tmp_path / "frozen"  # was told to give this user (root) write access, which root has
    frozen.mkdir()
    if subprocess.run(["chattr", "+i", frozen], capture_output=True).returncode == 0:
        try:
            result = vitctl("image", "build", "--dry-run", "--out", frozen / "img")
        finally:
            subprocess.run(["chattr", "-i", frozen], check=True)
        assert result.exit_code == 1 and f"{frozen} takes no new files: operation not permitted (an immutable " \
            f"folder, with an i in `lsattr -d {frozen}`, needs `chattr -i {frozen}`)" in result.stderr, result.stderr
        ok("image", "build", "--dry-run", "--out", frozen / "img")


def test_missing_build_tools_are_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
    result = vitctl("image", "build", "--out", tmp_path)
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    assert "needs buildah and mksquashfs: apt-get install buildah squashfs-tools" in result.stderr


# ---------------------------------------------------------------- launching ranks in the image


def test_train_with_a_squashfs_image_mounts_the_run_and_data_folders(prepared_shards, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))  # no sbatch: the dry run is not checked
    monkeypatch.chdir(tmp_path)
    sqsh, data = tmp_path / "vitctl.sqsh", prepared_shards
    sqsh.write_bytes(b"hsqs")
    script = ok("train", "--config", "demo_vit", "--set", "model.num_classes=5", "--data", data, "--out",
                tmp_path / "run", "--executor", "slurm", "--gpus", 2, "--batch", 4, "--container-image", "vitctl.sqsh",
                "--container-mounts", "/scratch:/scratch", "--dry-run").output
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert srun == (f"srun --container-image={sqsh} --container-mounts=/scratch:/scratch,{tmp_path}/run:{tmp_path}/run,"
                    f'{data}:{data} python3 -m vitctl.cli rank --max-requeues 3 --config "$config"')


def test_a_missing_image_file_and_a_local_image_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
    common = ["train", "--config", "demo_vit", "--set", "data.source=synthetic", "--out", tmp_path / "run"]
    result = vitctl(*common, "--executor", "slurm", "--gpus", 8, "--container-image", tmp_path / "no.sqsh", "--dry-run")
    assert result.exit_code == 1 and f"--container-image {tmp_path}/no.sqsh: no such file" in result.stderr
    result = vitctl(*common, "--executor", "local", "--gpus", 0, "--container-image", "x.sqsh")
    assert result.exit_code == 1 and "use it with --executor slurm" in result.stderr


def test_a_rank_refuses_a_job_pickled_by_another_vitctl(monkeypatch):
    job = TrainJob({"train": {"out_dir": "/nonexistent"}}, vitctl_version="0.0.1", git_commit="a" * 40)
    with pytest.raises(LaunchError, match=r"submitted by vitctl 0\.0\.1 \(commit aaaaaaaaaaaa\) but this rank runs "
                                          rf"vitctl {vitctl_version()}"):
        job()
    monkeypatch.setenv(IMAGE_COMMIT_ENV, "b" * 40)  # same version, an image of another commit
    same_version = TrainJob({"train": {"out_dir": "/nonexistent"}}, vitctl_version=vitctl_version(),
                            git_commit="a" * 40)
    with pytest.raises(LaunchError, match=r"runs vitctl .* \(commit bbbbbbbbbbbb\) \(the container image\)"):
        same_version()


def test_a_checkout_with_uncommitted_code_is_labelled_dirty_and_its_image_build_warns(tmp_path, monkeypatch):
    """An image of a checkout with local edits was labelled with HEAD alone: a job submitted from the same HEAD with
    other edits passed the ranks' check, and ran code other than its own."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True, text=True).stdout

    git("init", "-q")
    (tmp_path / "cli").mkdir()
    (tmp_path / "cli/main.py").write_text("print(1)\n")
    (tmp_path / "notes.md").write_text("notes\n")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    head = git("rev-parse", "HEAD").strip()
    monkeypatch.setattr(provenance, "SOURCE", tmp_path)
    monkeypatch.delenv(IMAGE_COMMIT_ENV, raising=False)
    assert provenance.git_commit() == head and image.uncommitted_warning() is None
    (tmp_path / "notes.md").write_text("other notes\n")  # not vitctl's code: the label stays
    assert provenance.git_commit() == head
    (tmp_path / "cli/main.py").write_text("print(2)\n")
    edited = provenance.git_commit()
    assert re.fullmatch(rf"{head}-dirty-[0-9a-f]{{12}}", edited) and provenance.git_commit() == edited
    assert f"it is labelled {head[:12]}{edited[40:]}, and its ranks refuse jobs submitted from any other state" in \
        image.uncommitted_warning()
    (tmp_path / "cli/new.py").write_text("")  # a file git does not track yet, which the image copies too
    assert provenance.git_commit() not in (head, edited)
    (tmp_path / "cli/new.py").unlink()
    assert provenance.git_commit() == edited
    monkeypatch.setenv(IMAGE_COMMIT_ENV, edited)  # in the image of the edited checkout, a job from the clean one
    with pytest.raises(LaunchError, match=rf"submitted by .*\(commit {head[:12]}\) but this rank runs .*"
                                          rf"\(commit {head[:12]}-dirty-"):
        TrainJob({"train": {"out_dir": "/nonexistent"}}, vitctl_version=vitctl_version(), git_commit=head)()


def test_in_the_image_a_missing_op_is_an_error_not_a_build(monkeypatch):
    import torch.utils.cpp_extension

    def no_build(*args, **kwargs):
        raise AssertionError("a just-in-time build was started")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_build)
    monkeypatch.setenv(cuda.PREBUILT_ONLY_ENV, "1")
    monkeypatch.setattr(cuda, "prebuilt", lambda: (None, "No module named 'vitctl_cuda_ops'"))
    cuda.extension.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="not prebuilt here .* VITCTL_PREBUILT_OPS=1 forbids building it"):
            cuda.extension()
    finally:
        cuda.extension.cache_clear()


@pytest.mark.parametrize(("value", "said"), [
    (None, "VITCTL_PREBUILT_OPS= (unset: a missing op would be compiled on first use)"),
    ("yes", "VITCTL_PREBUILT_OPS=yes ('yes': only 1 turns it on: a missing op would be compiled on first use)")])
def test_doctor_names_the_prebuilt_ops_setting_as_it_is(monkeypatch, value, said):
    """Before: `VITCTL_PREBUILT_OPS=yes` was reported unset."""
    if value is None:
        monkeypatch.delenv(cuda.PREBUILT_ONLY_ENV, raising=False)
    else:
        monkeypatch.setenv(cuda.PREBUILT_ONLY_ENV, value)
    result = vitctl("doctor", "--expect-image")
    cells = " ".join(result.output.replace("│", " ").split())  # a cell wrapped over lines reads as one
    assert result.exit_code == 1 and said in cells, result.output


def test_doctor_in_an_image_without_apex_exits_1_naming_what_is_missing(monkeypatch):
    monkeypatch.setenv(cuda.PREBUILT_ONLY_ENV, "1")  # as in the image: the self-test runs without --expect-image
    result = vitctl("doctor")
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    assert "the image lacks" in result.stderr and "apex: fused_layer_norm_cuda" in result.stderr
    assert "container image self-test" in result.output
