"""native-drafter's CLI: an operator's ordinary mistake is one line and exit 2 (1 means a
failed gate), never a traceback."""

import pytest

torch = pytest.importorskip("torch", reason="needs torch: the dev venv / tools/test's unit tier runs it")

from native_drafter.cli import main  # noqa: E402


def test_a_missing_tokenizer_and_a_gpu_that_is_not_there(tmp_path, capsys):
    assert main(["tokens", "--target", str(tmp_path / "nope"), "--corpus", str(tmp_path / "c.txt"),
                 "--out", str(tmp_path / "t.npy")]) == 2
    err = capsys.readouterr().err
    assert err == f"native-drafter tokens: no tokenizer.json in --target {tmp_path / 'nope'}\n"
    if not torch.cuda.is_available():  # the GPU machine runs the gate for real (benchmarks/gpu.sh)
        assert main(["gate", "--checkpoint", str(tmp_path), "--target", str(tmp_path)]) == 2
        assert "no CUDA GPU here" in capsys.readouterr().err
