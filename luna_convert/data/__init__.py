"""Loading task data (GLUE TSV / CSV / JSON lines / parquet / CoNLL / SQuAD JSON / the hub cache / ImageFolder /
scikit-learn digits) and turning it into deterministic PyTorch DataLoaders.

One concern a module, imported one way; which module holds what, in that order: CONTRIBUTING.md,
*Package map*. The rest of the package imports from this package itself.

Heavy libraries (datasets, transformers, torchvision, sklearn, pandas) are imported inside
the functions that need them.
"""

from __future__ import annotations

from .conll import datasets_token_split, load_token_split
from .hub import datasets_source, datasets_split_name, datasets_value_columns, load_datasets_dict
from .image_loader import image_transform, make_image_dataloader
from .images import DECODE_ALL_UP_TO, DigitsDataset, ImageFolderDataset, readable_images
from .labels import (align_labels, align_tag_labels, model_label_names, normalize_label_name, short_list,
                     token_label_names)
from .loading import load_split, read_sequence_split
from .splits import canonical_split, holdout_indices, take
from .tables import TABLE_EXTENSIONS, columns_to_dataset, find_split_file, read_table, text_encoding
from .sentences import embedding_texts, has_similarity_scores, load_sentence_split, sentence_dataset
from .squad import datasets_qa_split, load_qa_split, qa_dataset
from .text_loader import (QAExample, align_word_labels, answer_token_span, make_embedding_dataloader,
                          make_qa_dataloader, make_text_dataloader)

__all__ = [
    "load_split",
    "read_sequence_split",
    "load_token_split",
    "load_qa_split",
    "load_sentence_split",
    "datasets_token_split",
    "datasets_qa_split",
    "datasets_value_columns",
    "columns_to_dataset",
    "align_labels",
    "align_tag_labels",
    "make_text_dataloader",
    "align_word_labels",
    "make_qa_dataloader",
    "answer_token_span",
    "QAExample",
    "qa_dataset",
    "make_embedding_dataloader",
    "embedding_texts",
    "has_similarity_scores",
    "sentence_dataset",
    "token_label_names",
    "short_list",
    "image_transform",
    "make_image_dataloader",
    "ImageFolderDataset",
    "DigitsDataset",
    "normalize_label_name",
    "model_label_names",
    "canonical_split",
    "TABLE_EXTENSIONS",
    "find_split_file",
    "read_table",
    "text_encoding",
    "readable_images",
    "DECODE_ALL_UP_TO",
    "datasets_source",
    "load_datasets_dict",
    "datasets_split_name",
]
