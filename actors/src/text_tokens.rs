//! A gpt's text data as a token stream: the file's bytes (character level), or the ids a Hugging
//! Face `tokenizer.json` gives for it (the `tokenizers` crate, as `transformers` reads the same
//! file; no special tokens added, as `tokenizer(text, add_special_tokens=False)`). Every actor
//! reads and tokenizes the file itself: the same bytes and the same tokenizer give the same ids.

use archipelago_dataflow::data::TokenStream;

/// The stream a gpt of context `ctx` and vocabulary `vocab` trains on from text file `path`,
/// tokenized by `tokenizer` when given; refused (with the fix) when it does not fit the model.
pub fn text_stream(
    path: &str,
    tokenizer: Option<&str>,
    ctx: usize,
    vocab: usize,
) -> Result<TokenStream, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read --data {path}: {e}"))?;
    let Some(tokenizer) = tokenizer else {
        TokenStream::check_text(path, &bytes, ctx, vocab)?;
        return Ok(TokenStream::from_bytes(bytes));
    };
    let text = String::from_utf8(bytes)
        .map_err(|e| format!("--data {path} is not UTF-8 text ({e}), which --tokenizer needs"))?;
    let ids = token_ids(&load(tokenizer, vocab)?, &text, tokenizer)?;
    TokenStream::check_ids(path, tokenizer, &ids, ctx, vocab)?;
    Ok(TokenStream::from_ids(ids))
}

/// Reads `tokenizer.json` at `path`, refusing one whose vocabulary (special tokens included) is
/// larger than a gpt's `vocab`.
pub fn load(path: &str, vocab: usize) -> Result<tokenizers::Tokenizer, String> {
    let tokenizer = tokenizers::Tokenizer::from_file(path)
        .map_err(|e| format!("--tokenizer {path} is not a tokenizer.json that `tokenizers` reads: {e}"))?;
    let size = tokenizer.get_vocab_size(true);
    if size > vocab {
        return Err(format!(
            "--tokenizer {path} has a vocabulary of {size} tokens and the gpt's is vocab={vocab}: use vocab={size} or more"
        ));
    }
    Ok(tokenizer)
}

/// The ids `tokenizer` (read from `path`, named in errors) gives for `text`, special tokens not
/// added.
pub fn token_ids(tokenizer: &tokenizers::Tokenizer, text: &str, path: &str) -> Result<Vec<u32>, String> {
    let encoding = tokenizer
        .encode(text, false)
        .map_err(|e| format!("--tokenizer {path} cannot encode the text: {e}"))?;
    Ok(encoding.get_ids().to_vec())
}

/// Text to token ids, from any thread.
pub type Encode = dyn Fn(&str) -> Result<Vec<u32>, String> + Send + Sync;

/// The encoder and decoder generation uses: `tokenizer.json` at `tokenizer` (refused when its
/// vocabulary is larger than `vocab`), or bytes as tokens (ids past 255 decode to nothing).
pub fn codec(
    tokenizer: Option<&str>,
    vocab: usize,
) -> Result<(Box<Encode>, Box<crate::serving::SendDecode>), String> {
    let Some(path) = tokenizer else {
        if vocab < 256 {
            return Err(format!(
                "without --tokenizer the text's bytes are the tokens, which needs vocab ≥ 256 (the model has {vocab})"
            ));
        }
        let encode = |text: &str| Ok(text.bytes().map(u32::from).collect());
        let decode = |ids: &[u32]| {
            let bytes: Vec<u8> = ids.iter().filter_map(|&id| u8::try_from(id).ok()).collect();
            Ok(String::from_utf8_lossy(&bytes).into_owned())
        };
        return Ok((Box::new(encode), Box::new(decode)));
    };
    let tokenizer = std::sync::Arc::new(load(path, vocab)?);
    let (path, for_decode) = (path.to_string(), tokenizer.clone());
    let encode = move |text: &str| token_ids(&tokenizer, text, &path);
    let decode = move |ids: &[u32]| {
        (for_decode.decode(ids, false)).map_err(|e| format!("the tokenizer cannot decode {ids:?}: {e}"))
    };
    Ok((Box::new(encode), Box::new(decode)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> String {
        format!(
            "{}/../integration-tests/fixtures/tokenizer/{name}",
            env!("CARGO_MANIFEST_DIR")
        )
    }

    /// The ids `tokenizers` (Python, `scripts/tokenizer_fixture.py`) wrote for the fixture's text.
    #[test]
    fn ids_equal_the_python_tokenizers() {
        let expected: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(fixture("ids.json")).unwrap()).unwrap();
        let path = fixture("tokenizer.json");
        let tokenizer = load(&path, 320).unwrap();
        let ids = token_ids(&tokenizer, expected["text"].as_str().unwrap(), &path).unwrap();
        let want: Vec<u32> = (expected["ids"].as_array().unwrap().iter())
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(ids, want);
        assert_eq!(
            tokenizer.decode(&ids, false).unwrap(),
            expected["decoded"].as_str().unwrap()
        );
        // The control: bytes are not these ids.
        let bytes: Vec<u32> = expected["text"]
            .as_str()
            .unwrap()
            .bytes()
            .map(u32::from)
            .collect();
        assert_ne!(bytes, want);
    }

    #[test]
    fn a_vocabulary_larger_than_the_model_is_refused_with_the_fix() {
        let err = load(&fixture("tokenizer.json"), 256).unwrap_err();
        assert!(
            err.contains("vocabulary of 320 tokens") && err.contains("use vocab=320"),
            "{err}"
        );
        let err = load(&fixture("ids.json"), 512).unwrap_err();
        assert!(err.contains("is not a tokenizer.json"), "{err}");
    }
}
