//! Generated text streamed out as the tokens come: a chunk never ends inside a UTF-8 character
//! (a byte-level tokenizer may cut one across tokens; its decoder shows the missing bytes as
//! U+FFFD until they arrive) nor inside what may be the start of a stop sequence, and the text
//! ends before the first stop sequence it contains (the stop itself is not sent), as OpenAI's
//! and vLLM's servers stream it.

/// Decodes a whole token sequence to text.
pub type Decode<'a> = dyn Fn(&[u32]) -> Result<String, String> + 'a;

/// The text of one generated sequence, released chunk by chunk.
pub struct TextStream<'a> {
    decode: &'a Decode<'a>,
    stops: Vec<String>,
    ids: Vec<u32>,
    sent: String,
    stopped: bool,
}

impl<'a> TextStream<'a> {
    /// A stream of what `decode` makes of the generated tokens, ending before any of `stops`.
    pub fn new(decode: &'a Decode<'a>, stops: &[String]) -> TextStream<'a> {
        TextStream {
            decode,
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            ids: Vec::new(),
            sent: String::new(),
            stopped: false,
        }
    }

    /// Whether a stop sequence has ended the text.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Everything sent so far.
    pub fn text(&self) -> &str {
        &self.sent
    }

    /// One more generated token: the text that can go out now (maybe empty).
    pub fn push(&mut self, token: u32) -> Result<String, String> {
        if self.stopped {
            return Ok(String::new());
        }
        self.ids.push(token);
        let tail = self.tail()?;
        if let Some(at) = (self.stops.iter()).filter_map(|s| tail.find(s.as_str())).min() {
            self.stopped = true;
            return Ok(self.send(&tail[..at]));
        }
        // Hold a partial character, then any end that may begin a stop sequence.
        let whole = tail.trim_end_matches('\u{FFFD}');
        let held = (self.stops.iter())
            .flat_map(|stop| {
                (1..stop.len())
                    .filter(|&n| stop.is_char_boundary(n))
                    .map(move |n| &stop[..n])
            })
            .filter(|prefix| whole.ends_with(prefix))
            .map(str::len)
            .max()
            .unwrap_or(0);
        Ok(self.send(&whole[..whole.len() - held]))
    }

    /// The end of the sequence (no stop sequence came): whatever was held back.
    pub fn finish(&mut self) -> Result<String, String> {
        if self.stopped {
            return Ok(String::new());
        }
        let tail = self.tail()?;
        Ok(self.send(&tail))
    }

    /// The decoded text past what was sent.
    fn tail(&self) -> Result<String, String> {
        let text = (self.decode)(&self.ids)?;
        match text.strip_prefix(self.sent.as_str()) {
            Some(tail) => Ok(tail.to_string()),
            None => Err(format!(
                "the decoder rewrote text already sent ({:?} no longer begins {:?})",
                text, self.sent
            )),
        }
    }

    fn send(&mut self, chunk: &str) -> String {
        self.sent.push_str(chunk);
        chunk.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A byte-level decoder: each token is one byte, shown lossily as a tokenizer would.
    fn bytes(ids: &[u32]) -> Result<String, String> {
        Ok(String::from_utf8_lossy(&ids.iter().map(|&i| i as u8).collect::<Vec<_>>()).into_owned())
    }

    fn stream(text: &str, stops: &[&str]) -> (Vec<String>, bool) {
        let decode: &Decode = &bytes;
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut s = TextStream::new(decode, &stops);
        let mut chunks: Vec<String> = text.bytes().map(|b| s.push(u32::from(b)).unwrap()).collect();
        chunks.push(s.finish().unwrap());
        (chunks, s.stopped())
    }

    /// `é` and `🦀` cut across tokens never show half; the chunks add up to the text.
    #[test]
    fn no_chunk_splits_a_character() {
        let (chunks, stopped) = stream("héllo 🦀!", &[]);
        assert!(!stopped);
        assert!(chunks.iter().all(|c| !c.contains('\u{FFFD}')), "{chunks:?}");
        assert_eq!(chunks.concat(), "héllo 🦀!");
        assert_eq!(chunks[1], "", "the first byte of é waits for the second");
    }

    /// The text ends before the first stop sequence, which is never sent, even in part: its
    /// first bytes are held until they turn out not to be one; later text is not sent.
    #[test]
    fn a_stop_sequence_ends_the_text_and_is_never_sent() {
        let (chunks, stopped) = stream("one. two\n\nthree", &["\n\n", "END"]);
        assert!(stopped);
        assert_eq!(chunks.concat(), "one. two");
        let (chunks, stopped) = stream("an ENd, the END", &["END"]);
        assert!(stopped);
        assert_eq!(chunks.concat(), "an ENd, the ");
        let held = chunks.iter().position(|c| c.contains("ENd")).unwrap();
        assert_eq!(chunks[held - 1], "", "`E` waited for what followed it");
        let (chunks, stopped) = stream("no stop here EN", &["END"]);
        assert!(!stopped);
        assert_eq!(
            chunks.concat(),
            "no stop here EN",
            "a held prefix goes out at the end"
        );
    }
}
