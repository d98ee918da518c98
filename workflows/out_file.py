"""What the commands that write one file at --out (export, plan) refuse to write over."""

from pathlib import Path

from vitctl.trainer.checkpoint_files import is_checkpoint


def replacing_refusal(out: Path) -> str | None:
    """Why writing `out` by renaming a new file onto it would destroy something, or None: a checkpoint's folder (its
    files, or a file keep-last-K would trip over), a link or a device (replaced, not written through)."""
    if inside := next((p for p in out.absolute().parents if is_checkpoint(p)), None):
        return (f"--out {out} lies in the checkpoint folder {inside}, which holds what training wrote there alone: "
                f"writing there could destroy the checkpoint; choose an --out outside {inside.parent}")
    if out.is_symlink() or (out.exists() and not out.is_file()):
        return (f"--out {out} is {'a symbolic link' if out.is_symlink() else 'not a regular file'}: writing would "
                "replace it, not write through it; choose another --out")
    return None
