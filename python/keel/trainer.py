"""keel.Trainer: `keel train` from Python, the same trainer as the CLI, with callbacks."""
import json
import os
import signal
import sys

from . import _native
from .config import TrainingConfig


class Trainer:
    """Trainer(config).train() runs the recipe as `keel train` would and returns the run's summary
    (summary.json's contents). Writes the same files: output_dir/metrics.jsonl, summary.json,
    loss.svg, final/, checkpoints, TensorBoard events with report_to="tensorboard".

    callbacks: objects with any of on_log(step, metrics), on_evaluate(step, metrics),
    on_save(step, directory) — or pass those functions as keywords. on_log gets metrics.jsonl's
    record of each step at the log interval (and the last); an exception raised in a callback
    stops the run and propagates. The GIL is released while keel trains: other Python threads run.
    Ctrl-C stops at the end of the current step (saving a checkpoint when checkpoint_dir is set,
    else output_dir/interrupted/) and raises KeyboardInterrupt.
    """

    def __init__(self, config, callbacks=(), on_log=None, on_evaluate=None, on_save=None):
        if not isinstance(config, TrainingConfig):
            raise TypeError("Trainer(config): config must be a keel.TrainingConfig, got %s" % type(config).__name__)
        self.config = config
        self._callbacks = list(callbacks)
        for name, fn in (("on_log", on_log), ("on_evaluate", on_evaluate), ("on_save", on_save)):
            if fn is not None:
                self._callbacks.append(type("_Callback", (), {name: staticmethod(fn)})())
        self.summary = None

    def _dispatch(self, name):
        targets = [getattr(c, name) for c in self._callbacks if callable(getattr(c, name, None))]
        if not targets:
            return None

        def call(*args):
            for fn in targets:
                fn(*args)
        return call

    def train(self, resume=None, overwrite=False, stop_after=0):
        """resume: None (a fresh run), "auto" (the latest checkpoint in checkpoint_dir, if any) or a
        checkpoint directory; overwrite: replace an earlier run's checkpoints; stop_after: stop
        (saving) after this step. Returns the summary dict ("interrupted": True when stopped early)."""
        sys.stdout.flush()
        sys.stderr.flush()
        result = _native.train(self.config.to_toml(), "TrainingConfig", resume or "", bool(overwrite),
                               int(stop_after), self._dispatch("on_log"), self._dispatch("on_evaluate"),
                               self._dispatch("on_save"))
        self.summary = json.loads(result["summary_json"])
        self.summary["interrupted"] = bool(result["interrupted"])
        if result["signal"] == signal.SIGINT:
            raise KeyboardInterrupt("keel: training stopped by Ctrl-C after %d step(s) of this run; resume with "
                                    "train(resume=\"auto\")" % self.summary.get("steps", 0))
        return self.summary

    def evaluate(self):
        """Loss and perplexity on eval_data_path, computed as training evaluates. After train():
        of the trained model (output_dir/final: the model, or the LoRA adapter on model_name);
        before: of the config's model. Returns {"eval_loss", "eval_perplexity", "eval_target_tokens"}."""
        config = self.config
        if self.summary is not None and not self.summary.get("interrupted"):
            values = config.to_dict()
            final = os.path.join(config.output_dir, "final")
            if config.finetuning_type == "lora":
                values["adapter_name_or_path"] = final
            else:
                values["model_name"] = final
                values.pop("model_config", None)
            config = TrainingConfig(**values)
        sys.stdout.flush()
        return dict(_native.evaluate(config.to_toml(), "TrainingConfig"))
