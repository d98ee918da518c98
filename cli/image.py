"""`vitctl image build`: the prebuilt container image, as an OCI archive and as a squashfs that pyxis runs."""

import shlex
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import click

from vitctl.workflows import image as wf
from vitctl.workflows.provenance import vitctl_version

from .commands import summary
from .console import GivenPath, console, err_console

T = TypeVar("T")


@click.group(short_help=summary("image"))
def image() -> None:
    """The prebuilt container image (containers/)."""


@image.command()
@click.option("--base", default=wf.DEFAULT_BASE, show_default=True,
              callback=lambda ctx, param, base: _checked(base, wf.base_problem),
              help="Image with a CUDA build of torch and its nvcc: an NGC PyTorch image, or the offline base that "
                   "containers/base/build-base builds (localhost/vitctl-base:torch2.11.0).")
@click.option("--tag", callback=lambda ctx, param, tag: _checked(tag, wf.tag_problem),
              help="Name of the image [default: localhost/vitctl:VERSION].")
@click.option("--out", type=GivenPath(file_okay=False, path_type=Path), default=wf.ImageRequest.out,
              show_default=True, help="Folder for NAME.oci.tar and NAME.sqsh.")
@click.option("--arch-list", default=wf.DEFAULT_ARCHS, show_default=True,
              callback=lambda ctx, param, archs: _checked(archs, wf.arch_list_problem),
              help="TORCH_CUDA_ARCH_LIST: the GPU archs the ops and apex are compiled for.")
@click.option("--apex", "apex_archive", type=GivenPath(dir_okay=False, path_type=Path),
              callback=lambda ctx, param, archive: _checked(archive, wf.apex_archive_problem),
              help="apex's source as a .tar.gz, for builds without access to its git repository "
                   "[default: the pinned git ref].")
@click.option("--max-jobs", type=click.IntRange(min=1), help="Parallel compiler jobs [default: one per CPU].")
@click.option("--dry-run", is_flag=True, help="Print the commands; build nothing.")
def build(base: str, tag: str | None, out: Path, arch_list: str, apex_archive: Path | None, max_jobs: int | None,
          dry_run: bool) -> None:
    """Build containers/Containerfile with buildah; write OUT/NAME.oci.tar (for docker, podman, Apptainer) and
    OUT/NAME.sqsh, which `vitctl train --container-image OUT/NAME.sqsh` runs every rank in."""
    request = wf.ImageRequest(base, tag or f"localhost/vitctl:{vitctl_version()}", out, arch_list,
                              apex_archive.absolute() if apex_archive else None, max_jobs)
    if dry_run:
        wf.check_request(request)
        if warning := wf.uncommitted_warning():
            err_console.print(f"warning: {warning}", highlight=False, soft_wrap=True)
        click.echo("\n".join(wf.plan(request)))
        return
    built = wf.build(request, lambda text: err_console.print(text, highlight=False, soft_wrap=True))
    gib = 2**30
    console.print(f"built {request.tag} in {built.seconds / 60:.1f} min\n"
                  f"OCI archive: {built.outputs.oci_archive} ({built.oci_bytes / gib:.2f} GiB)\n"
                  f"squashfs:    {built.outputs.squashfs} ({built.squashfs_bytes / gib:.2f} GiB)\n"
                  f"run it: vitctl train ... --executor slurm --container-image "
                  f"{shlex.quote(str(built.outputs.squashfs))}",
                  highlight=False, soft_wrap=True)


def _checked(value: T | None, problem: Callable[[T], str | None]) -> T | None:
    """`value` if `problem` finds none in it: what buildah or the build would refuse is refused before it starts."""
    if value is not None and (found := problem(value)):
        raise click.BadParameter(found)
    return value
