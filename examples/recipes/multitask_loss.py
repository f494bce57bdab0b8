"""Recipe 2: a multi-task loss, main loss plus a weighted auxiliary loss, with a time-varying weight
`alpha = 0.5 + 0.1 * sin(step / 100)`.

Main task: is a Rotten Tomatoes review fresh or rotten. Auxiliary task, from the same real data: is the review
longer than the median review (a cheap signal that shapes the encoder). One shared encoder, two heads:

    loss = main_loss + alpha(step) * aux_loss

Two styles, split by what each owns:
* stage subclass: `MultiTaskStep(StepStage)` overrides `compute_loss` (the *what*: how the two losses combine) and
  reads `self.alpha`. Alone it uses the schedule itself at `on_step_begin` (stages receive events).
* callback: `AlphaSchedule` sets `alpha` from `on_step_begin` (the *when*), for a step stage built with
  `schedule_alpha=False`, or for an HF `Trainer` subclass doing the same in `compute_loss`.

`step` is `state.global_step` at `on_step_begin`: the number of optimizer steps already taken. Every step's alpha and
loss parts are kept in `history` (device tensors: recording them costs no sync).
"""

from __future__ import annotations

import math

from torch import nn

from common import ReviewDataset, Size, cli, load_classifier, loop_args, output_folder, review_split
from loopkit import Loop, StepStage


def alpha_at(step: int) -> float:
    return 0.5 + 0.1 * math.sin(step / 100)


class SentimentAndLength(nn.Module):
    """A BERT classifier (main head) plus a linear auxiliary head on the same [CLS] representation."""

    def __init__(self, classifier):
        super().__init__()
        self.classifier = classifier
        self.aux_head = nn.Linear(classifier.config.hidden_size, 2)

    def forward(self, input_ids, attention_mask, labels=None, aux_labels=None):
        out = self.classifier(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                              output_hidden_states=True)
        aux_logits = self.aux_head(out.hidden_states[-1][:, 0])
        aux_loss = nn.functional.cross_entropy(aux_logits, aux_labels) if aux_labels is not None else None
        return {"main_loss": out.loss, "aux_loss": aux_loss, "logits": out.logits, "aux_logits": aux_logits}


class MultiTaskStep(StepStage):
    """Stage style: the step stage combines the two losses with the current alpha."""

    def __init__(self, schedule_alpha: bool = True):
        super().__init__()
        self.schedule_alpha = schedule_alpha
        self.alpha = alpha_at(0)
        self.history = []  # (step, alpha, main_loss, aux_loss) per micro-batch

    def on_step_begin(self, args, state, control, **kwargs):
        if self.schedule_alpha:
            self.alpha = alpha_at(state.global_step)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        loss = outputs["main_loss"] + self.alpha * outputs["aux_loss"]
        if model.training:
            self.history.append((self.run.state.global_step, self.alpha, outputs["main_loss"].detach(),
                                 outputs["aux_loss"].detach()))
        outputs["loss"] = loss
        return (loss, outputs) if return_outputs else loss


class AlphaSchedule:
    """Callback style: sets the weight on a target (anything with an `alpha` attribute) before every step."""

    def __init__(self, target):
        self.target = target

    def on_step_begin(self, args, state, control, **kwargs):
        self.target.alpha = alpha_at(state.global_step)


def both_accuracies(eval_prediction) -> dict:
    """`compute_metrics`: accuracy of the main (sentiment) and the auxiliary (length) head."""
    (logits, aux_logits), (labels, aux_labels) = eval_prediction.predictions, eval_prediction.label_ids
    return {"accuracy": float((logits.argmax(-1) == labels).mean()),
            "aux_accuracy": float((aux_logits.argmax(-1) == aux_labels).mean())}


def datasets(size: Size):
    train_rows, eval_rows = review_split(size.n_train, size.n_eval)
    median_words = sorted(len(text.split()) for text, _ in train_rows)[len(train_rows) // 2]

    def with_length_label(rows):
        return ReviewDataset(rows, size.max_length,
                             extra={"aux_labels": [int(len(text.split()) > median_words) for text, _ in rows]})

    return with_length_label(train_rows), with_length_label(eval_rows)


def main(tiny: bool = False, output_dir: str | None = None, style: str = "stage", max_steps: int = -1):
    size = Size.pick(tiny)
    train, evaluation = datasets(size)
    step = MultiTaskStep(schedule_alpha=(style == "stage"))
    callbacks = [AlphaSchedule(step)] if style == "callback" else []
    args = loop_args(output_folder(output_dir, "multitask"), size, max_steps=max_steps,
                     label_names=["labels", "aux_labels"])
    loop = Loop(model=SentimentAndLength(load_classifier(size)), args=args, train_dataset=train,
                eval_dataset=evaluation, compute_metrics=both_accuracies, step=step, callbacks=callbacks)
    loop.train()
    loop.evaluate(ignore_keys=["main_loss", "aux_loss"])  # the metrics need the two heads' logits only
    first, last = step.history[0], step.history[-1]
    print(f"alpha went from {first[1]:.4f} (step {first[0]}) to {last[1]:.4f} (step {last[0]})")
    return loop, step


if __name__ == "__main__":
    cli(main, __doc__)
