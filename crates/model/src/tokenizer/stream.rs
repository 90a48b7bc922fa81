//! Streaming decode: the text each new token id completes, for server-sent events.
//!
//! Decoding ids one at a time and concatenating is wrong: a character may be spread over
//! several byte tokens (`<0xE6><0x97><0xA5>`, or byte-level pieces of an emoji), and decoders
//! that strip a leading space (SentencePiece) would eat every word's space. [`DecodeStream`]
//! decodes a small window instead: the ids it last emitted (as context) plus the new ones, and
//! hands out only what the window adds to the context's text, once that no longer ends in an
//! incomplete character (U+FFFD). This is the algorithm of `tokenizers`' own `DecodeStream`,
//! kept here with owned state so one stream per sequence can live in a scheduler's tables
//! without borrowing the tokenizer.
//!
//! The texts returned by [`DecodeStream::step`], followed by [`DecodeStream::finish`], add up to
//! the decode of all the ids at once.

use super::{Tokenizer, TokenizerError};

/// The decoder's mark for bytes that are not (yet) a whole UTF-8 character.
const REPLACEMENT: char = '\u{FFFD}';

/// Incremental decoder state for one sequence.
#[derive(Debug, Clone, Default)]
pub struct DecodeStream {
    skip_special_tokens: bool,
    /// Context ids (already emitted), then ids whose text is still pending.
    ids: Vec<u32>,
    /// The text of `ids[..context_len]`, as decoded in this window.
    context: String,
    context_len: usize,
}

impl DecodeStream {
    /// A stream that starts with no context.
    pub fn new(skip_special_tokens: bool) -> Self {
        DecodeStream {
            skip_special_tokens,
            ..DecodeStream::default()
        }
    }

    /// Takes the next id; returns the text it completes, if any.
    pub fn step(
        &mut self,
        tokenizer: &Tokenizer,
        id: u32,
    ) -> Result<Option<String>, TokenizerError> {
        self.ids.push(id);
        let text = tokenizer.decode(&self.ids, self.skip_special_tokens)?;
        if text.len() <= self.context.len() || text.ends_with(REPLACEMENT) {
            return Ok(None);
        }
        let Some(new_text) = text.strip_prefix(self.context.as_str()) else {
            return Err(TokenizerError::StreamPrefix {
                id,
                expected: self.context.clone(),
                actual: text,
            });
        };
        let new_text = new_text.to_string();
        // What was just emitted becomes the context of the next window.
        self.ids.drain(..self.context_len);
        self.context = tokenizer.decode(&self.ids, self.skip_special_tokens)?;
        self.context_len = self.ids.len();
        Ok(Some(new_text))
    }

    /// Ends the sequence: returns any pending text, even an incomplete character (as U+FFFD),
    /// and resets the stream.
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> Result<Option<String>, TokenizerError> {
        let text = tokenizer.decode(&self.ids, self.skip_special_tokens)?;
        let rest = match text.strip_prefix(self.context.as_str()) {
            Some(rest) if !rest.is_empty() => Some(rest.to_string()),
            Some(_) => None,
            None => {
                return Err(TokenizerError::StreamPrefix {
                    id: self.ids.last().copied().unwrap_or_default(),
                    expected: self.context.clone(),
                    actual: text,
                });
            }
        };
        *self = DecodeStream::new(self.skip_special_tokens);
        Ok(rest)
    }
}
