//! Incremental detokenization with stop strings: the text each sampled token adds to a
//! choice, never a broken UTF-8 character, and never a piece of a stop string.
//!
//! Decoding uses the prefix-offset method of [`DecodeStream`] (vLLM's and `tokenizers`'):
//! decode a small window of ids, emit only the suffix it adds to the text already emitted,
//! and hold back while that suffix ends in U+FFFD (a character whose bytes are spread over
//! tokens that have not all arrived).
//!
//! Stop strings are matched on the decoded text, across token boundaries: [`TextStream`]
//! also holds back the longest tail of the text that could still grow into a stop string.
//! Once one matches, the text before it is the last output and the stop string itself is
//! cut, as OpenAI does.

use std::sync::Arc;

use tessera_model::tokenizer::{DecodeStream, Tokenizer, TokenizerError};

/// What one token (or the end of the sequence) adds to a choice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum TextStep {
    /// Text to send; may be empty while characters or a possible stop string are pending.
    Text(String),
    /// A stop string matched: the text before it, and nothing after.
    Stopped(String),
}

/// The text of one sequence, token by token.
#[derive(Debug)]
pub(crate) struct TextStream {
    /// `None`: a model without a tokenizer, whose choices carry no text.
    tokenizer: Option<Arc<Tokenizer>>,
    decoder: DecodeStream,
    stops: Arc<[String]>,
    /// Decoded text not sent yet: it ends with what could start a stop string.
    pending: String,
}

impl TextStream {
    pub(crate) fn new(tokenizer: Option<Arc<Tokenizer>>, stops: Arc<[String]>) -> TextStream {
        TextStream {
            tokenizer,
            // Special tokens (EOS, chat markers) are not part of the text, as in OpenAI.
            decoder: DecodeStream::new(true),
            stops,
            pending: String::new(),
        }
    }

    /// Takes the next sampled token.
    pub(crate) fn push(&mut self, token: u32) -> Result<TextStep, TokenizerError> {
        let Some(tokenizer) = &self.tokenizer else {
            return Ok(TextStep::Text(String::new()));
        };
        if let Some(text) = self.decoder.step(tokenizer, token)? {
            self.pending.push_str(&text);
        }
        Ok(self.release(false))
    }

    /// Ends the sequence: whatever is still pending, an incomplete character included.
    pub(crate) fn finish(&mut self) -> Result<TextStep, TokenizerError> {
        let Some(tokenizer) = &self.tokenizer else {
            return Ok(TextStep::Text(String::new()));
        };
        if let Some(text) = self.decoder.finish(tokenizer)? {
            self.pending.push_str(&text);
        }
        Ok(self.release(true))
    }

    /// Cuts `pending` at a matched stop string, or sends all of it that cannot start one.
    fn release(&mut self, at_end: bool) -> TextStep {
        if let Some(at) = self.first_stop() {
            self.pending.truncate(at);
            return TextStep::Stopped(std::mem::take(&mut self.pending));
        }
        let keep = if at_end { 0 } else { self.stop_prefix_len() };
        let rest = self.pending.split_off(self.pending.len() - keep);
        TextStep::Text(std::mem::replace(&mut self.pending, rest))
    }

    /// The byte offset of the earliest stop string in `pending`.
    fn first_stop(&self) -> Option<usize> {
        self.stops
            .iter()
            .filter_map(|stop| self.pending.find(stop.as_str()))
            .min()
    }

    /// The length of the longest tail of `pending` that is a proper prefix of a stop string.
    fn stop_prefix_len(&self) -> usize {
        self.stops
            .iter()
            .filter_map(|stop| {
                (1..stop.len())
                    .rev()
                    .find(|&len| stop.is_char_boundary(len) && self.pending.ends_with(&stop[..len]))
            })
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    fn tokenizer() -> Arc<Tokenizer> {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../fixtures/tokenizers/tiny-spm/tokenizer.json");
        Arc::new(Tokenizer::from_file(path).expect("the tiny-spm fixture loads"))
    }

    /// Every step's text, concatenated, and whether a stop string ended it.
    fn run(tokenizer: &Arc<Tokenizer>, ids: &[u32], stops: &[&str]) -> (Vec<String>, bool) {
        let stops: Arc<[String]> = stops.iter().map(|s| s.to_string()).collect();
        let mut stream = TextStream::new(Some(Arc::clone(tokenizer)), stops);
        let mut out = Vec::new();
        for &id in ids {
            match stream.push(id).unwrap() {
                TextStep::Text(t) => out.push(t),
                TextStep::Stopped(t) => {
                    out.push(t);
                    return (out, true);
                }
            }
        }
        match stream.finish().unwrap() {
            TextStep::Text(t) => out.push(t),
            TextStep::Stopped(t) => {
                out.push(t);
                return (out, true);
            }
        }
        (out, false)
    }

    /// "a日b" with 日 (E6 97 A5) spelled as three byte-fallback tokens.
    fn split_character(tok: &Tokenizer) -> Vec<u32> {
        let mut ids = tok.encode("a", false).unwrap();
        for byte in ["<0xE6>", "<0x97>", "<0xA5>"] {
            ids.push(tok.token_to_id(byte).expect("byte-fallback token"));
        }
        ids.push(tok.token_to_id("b").expect("token b"));
        ids
    }

    #[test]
    fn multi_byte_character_split_across_tokens_is_never_broken() {
        let tok = tokenizer();
        let ids = split_character(&tok);
        let full = tok.decode(&ids, true).unwrap();
        assert!(full.contains('日'), "{full:?}");
        let (pieces, stopped) = run(&tok, &ids, &[]);
        assert!(!stopped);
        for piece in &pieces {
            assert!(
                !piece.contains('\u{FFFD}'),
                "broken character in {pieces:?}"
            );
        }
        // The character comes whole, with its last byte.
        assert_eq!(pieces[1..3], ["", ""], "{pieces:?}");
        assert!(pieces[3].contains('日'), "{pieces:?}");
        assert_eq!(pieces.concat(), full);
    }

    #[test]
    fn text_adds_up_to_the_whole_decode() {
        let tok = tokenizer();
        let ids = tok.encode("hello world, the end", false).unwrap();
        let (pieces, stopped) = run(&tok, &ids, &[]);
        assert!(!stopped);
        assert_eq!(pieces.concat(), tok.decode(&ids, true).unwrap());
        assert!(
            pieces.iter().filter(|p| !p.is_empty()).count() > 1,
            "{pieces:?}"
        );
    }

    #[test]
    fn stop_string_across_tokens_is_cut() {
        let tok = tokenizer();
        let ids = tok.encode("hello world, the end", false).unwrap();
        let full = tok.decode(&ids, true).unwrap();
        let (pieces, stopped) = run(&tok, &ids, &["ld, t"]);
        assert!(stopped);
        let at = full.find("ld, t").unwrap();
        assert_eq!(pieces.concat(), full[..at]);
        // Nothing of the stop string was ever sent.
        assert!(!pieces.concat().contains("ld"));
    }

    #[test]
    fn stop_string_with_a_multi_byte_character() {
        let tok = tokenizer();
        let ids = split_character(&tok);
        let full = tok.decode(&ids, true).unwrap();
        let (pieces, stopped) = run(&tok, &ids, &["日"]);
        assert!(stopped);
        assert_eq!(pieces.concat(), full[..full.find('日').unwrap()]);
    }

    #[test]
    fn a_possible_stop_prefix_is_released_at_the_end() {
        let tok = tokenizer();
        let ids = tok.encode("hello wor", false).unwrap();
        let (pieces, stopped) = run(&tok, &ids, &["world"]);
        assert!(!stopped);
        assert_eq!(pieces.concat(), tok.decode(&ids, true).unwrap());
    }

    #[test]
    fn no_tokenizer_means_no_text() {
        let mut stream = TextStream::new(None, Arc::from(vec!["x".to_string()]));
        assert_eq!(stream.push(5).unwrap(), TextStep::Text(String::new()));
        assert_eq!(stream.finish().unwrap(), TextStep::Text(String::new()));
    }
}
