//! `--data FILE.txt --tokenizer tokenizer.json`: a gpt trains on the text's token ids (the loss
//! falls from ln(vocab)); a tokenizer whose vocabulary the gpt cannot hold, and a tokenizer with a
//! batch file, are refused before launch with the fix.

mod common;

use common::{archipelago, refused};

fn fixture(name: &str) -> String {
    format!(
        "{}/../integration-tests/fixtures/tokenizer/{name}",
        env!("CARGO_MANIFEST_DIR")
    )
}

/// The fixture tokenizer's corpus, repeated: text its merges were learned on.
fn text_file(dir: &std::path::Path) -> String {
    let line = "The quick brown fox jumps over the lazy dog. A single controller compiles one program \
                into a stream per device.\n";
    let path = dir.join("corpus.txt");
    std::fs::write(&path, line.repeat(40)).unwrap();
    path.display().to_string()
}

#[test]
fn a_gpt_trains_on_tokenized_text_and_bad_tokenizers_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let text = text_file(dir.path());
    let tokenizer = fixture("tokenizer.json");
    let (ok, out) = archipelago(&[
        "train",
        "--model",
        "gpt:vocab=320,ctx=8,d=32,layers=2,heads=2",
        "--steps",
        "30",
        "--batch",
        "8",
        "--lr",
        "0.01",
        "--data",
        &text,
        "--tokenizer",
        &tokenizer,
    ]);
    assert!(ok, "{out}");
    assert!(out.contains("tokenized by"), "{out}");
    let losses: Vec<f64> = (out.lines())
        .filter_map(|l| l.split("loss ").nth(1))
        .filter_map(|rest| rest.split_whitespace().next()?.parse().ok())
        .collect();
    assert!(losses.len() >= 2, "{out}");
    let (first, last) = (losses[0], *losses.last().unwrap());
    assert!(
        (first - (320f64).ln()).abs() < 0.5,
        "the first loss is near ln(320): {first}"
    );
    assert!(
        last < first - 1.0,
        "the loss falls on a repeated text: {first} → {last}"
    );
    refused(
        &[
            "train",
            "--model",
            "gpt:vocab=256,ctx=8,d=16,layers=2,heads=2",
            "--steps",
            "1",
            "--data",
            &text,
            "--tokenizer",
            &tokenizer,
        ],
        &["has a vocabulary of 320 tokens", "use vocab=320 or more"],
    );
    refused(
        &[
            "train",
            "--model",
            "gpt:vocab=320,ctx=8,d=16,layers=2,heads=2",
            "--steps",
            "1",
            "--data",
            &text,
            "--tokenizer",
            &fixture("ids.json"),
        ],
        &["is not a tokenizer.json"],
    );
}
