"""transformers' examples/pytorch/text-classification/run_classification.py, condensed to its Trainer path: CSV files
in, `train()`, `save_model()`, `log_metrics`/`save_metrics`/`save_state`, `evaluate()`, `predict()` to
`predict_results.txt`, and the model card. tests/test_example_scripts.py runs it with HF Trainer and, changing only
the Trainer import line, with loopkit. Its one departure from the original: accuracy is computed with numpy, since
`evaluate.load("accuracy")` needs the Hub.
"""

import logging
import os
from dataclasses import dataclass, field

import numpy as np
from datasets import load_dataset
from transformers import (AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding,
                          EvalPrediction, HfArgumentParser, TrainingArguments, default_data_collator, set_seed)
from transformers import Trainer

logger = logging.getLogger(__name__)


@dataclass
class DataTrainingArguments:
    train_file: str = field(metadata={"help": "A csv file with the training data (columns sentence, label)."})
    validation_file: str = field(metadata={"help": "A csv file with the validation data."})
    test_file: str | None = field(default=None, metadata={"help": "A csv file with the test data."})
    max_seq_length: int = field(default=128, metadata={"help": "Longer sequences are truncated."})
    pad_to_max_length: bool = field(default=False, metadata={"help": "Pad to max_seq_length, else per batch."})
    max_train_samples: int | None = field(default=None)
    max_eval_samples: int | None = field(default=None)
    max_predict_samples: int | None = field(default=None)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "Path to a pretrained model or its name on the Hub."})
    cache_dir: str | None = field(default=None, metadata={"help": "Where datasets and models are cached."})


def main(argv=None):
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    set_seed(training_args.seed)

    data_files = {"train": data_args.train_file, "validation": data_args.validation_file}
    if training_args.do_predict:
        data_files["test"] = data_args.test_file
    raw_datasets = load_dataset("csv", data_files=data_files, cache_dir=model_args.cache_dir)
    label_list = sorted(raw_datasets["train"].unique("label"))
    num_labels = len(label_list)

    config = AutoConfig.from_pretrained(model_args.model_name_or_path, num_labels=num_labels,
                                        finetuning_task="text-classification")
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    model = AutoModelForSequenceClassification.from_pretrained(model_args.model_name_or_path, config=config)
    label_to_id = {v: i for i, v in enumerate(label_list)}
    model.config.label2id = label_to_id
    model.config.id2label = {i: label for label, i in label_to_id.items()}

    padding = "max_length" if data_args.pad_to_max_length else False
    max_seq_length = min(data_args.max_seq_length, tokenizer.model_max_length)

    def preprocess_function(examples):
        result = tokenizer(examples["sentence"], padding=padding, max_length=max_seq_length, truncation=True)
        result["label"] = [label_to_id[label] for label in examples["label"]]
        return result

    with training_args.main_process_first(desc="dataset map pre-processing"):
        raw_datasets = raw_datasets.map(preprocess_function, batched=True, load_from_cache_file=False)

    train_dataset = raw_datasets["train"]
    if data_args.max_train_samples is not None:
        train_dataset = train_dataset.select(range(min(len(train_dataset), data_args.max_train_samples)))
    eval_dataset = raw_datasets["validation"]
    if data_args.max_eval_samples is not None:
        eval_dataset = eval_dataset.select(range(min(len(eval_dataset), data_args.max_eval_samples)))
    if training_args.do_predict:
        predict_dataset = raw_datasets["test"]
        if data_args.max_predict_samples is not None:
            predict_dataset = predict_dataset.select(range(min(len(predict_dataset), data_args.max_predict_samples)))

    def compute_metrics(p: EvalPrediction):
        preds = p.predictions[0] if isinstance(p.predictions, tuple) else p.predictions
        preds = np.argmax(preds, axis=1)
        return {"accuracy": float((preds == p.label_ids).astype(np.float32).mean())}

    if data_args.pad_to_max_length:
        data_collator = default_data_collator
    elif training_args.fp16:
        data_collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)
    else:
        data_collator = None

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=eval_dataset if training_args.do_eval else None,
        compute_metrics=compute_metrics,
        processing_class=tokenizer,
        data_collator=data_collator,
    )

    if training_args.do_train:
        train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        metrics = train_result.metrics
        max_train_samples = data_args.max_train_samples or len(train_dataset)
        metrics["train_samples"] = min(max_train_samples, len(train_dataset))
        trainer.save_model()  # Saves the tokenizer too for easy upload
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    if training_args.do_eval:
        logger.info("*** Evaluate ***")
        metrics = trainer.evaluate(eval_dataset=eval_dataset)
        max_eval_samples = data_args.max_eval_samples or len(eval_dataset)
        metrics["eval_samples"] = min(max_eval_samples, len(eval_dataset))
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)

    if training_args.do_predict:
        logger.info("*** Predict ***")
        predict_dataset = predict_dataset.remove_columns("label")
        predictions = trainer.predict(predict_dataset, metric_key_prefix="predict").predictions
        predictions = np.argmax(predictions, axis=1)
        output_predict_file = os.path.join(training_args.output_dir, "predict_results.txt")
        if trainer.is_world_process_zero():
            with open(output_predict_file, "w") as writer:
                writer.write("index\tprediction\n")
                for index, item in enumerate(predictions):
                    writer.write(f"{index}\t{model.config.id2label[item]}\n")

    kwargs = {"finetuned_from": model_args.model_name_or_path, "tasks": "text-classification"}
    if training_args.push_to_hub:
        trainer.push_to_hub(**kwargs)
    else:
        trainer.create_model_card(**kwargs)
    return trainer


if __name__ == "__main__":
    main()
