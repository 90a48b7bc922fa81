//! Server-sent events as OpenAI-compatible servers stream them: a pure, incremental parser
//! (bytes in, events out, in any split across reads), [`SseStream`], which reads a response
//! body through it and stamps each read with the instant its bytes arrived, and the
//! reading of one streamed chunk. `tessera generate --url` and `tessera bench` read their
//! streams through these.
//!
//! The parser follows the WHATWG event-stream rules the servers use: lines end in `\n`,
//! `\r\n` or `\r`; `data:` lines of one event join with `\n`; `event:` names it; a line
//! starting with `:` is a comment (keep-alive pings); an empty line ends the event.

use std::io::Read;
use std::time::Instant;

use serde_json::Value;

/// One event of the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    /// The `event:` name, when the server gave one (`error` on some servers).
    pub name: Option<String>,
    /// The joined `data:` lines.
    pub data: String,
}

/// Turns the bytes of a response body into [`SseEvent`]s.
#[derive(Debug, Default)]
pub struct SseParser {
    /// Bytes of a line not ended yet.
    line: Vec<u8>,
    /// The last byte was a `\r`: a `\n` right after it ends nothing more.
    after_cr: bool,
    name: Option<String>,
    data: Option<String>,
}

impl SseParser {
    /// Feeds the next bytes; returns the events they complete, in order.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<SseEvent> {
        let mut events = Vec::new();
        for &byte in bytes {
            match byte {
                b'\n' if self.after_cr => self.after_cr = false,
                b'\n' | b'\r' => {
                    self.after_cr = byte == b'\r';
                    let line = std::mem::take(&mut self.line);
                    if let Some(event) = self.line_done(&line) {
                        events.push(event);
                    }
                }
                _ => {
                    self.after_cr = false;
                    self.line.push(byte);
                }
            }
        }
        events
    }

    /// The event still open when the body ended without its empty line, if any.
    pub fn finish(&mut self) -> Option<SseEvent> {
        let line = std::mem::take(&mut self.line);
        if !line.is_empty()
            && let Some(event) = self.line_done(&line)
        {
            return Some(event);
        }
        self.dispatch()
    }

    fn line_done(&mut self, line: &[u8]) -> Option<SseEvent> {
        if line.is_empty() {
            return self.dispatch();
        }
        if line[0] == b':' {
            return None;
        }
        let line = String::from_utf8_lossy(line);
        let (field, value) = match line.split_once(':') {
            Some((field, value)) => (field, value.strip_prefix(' ').unwrap_or(value)),
            None => (line.as_ref(), ""),
        };
        match field {
            "data" => match &mut self.data {
                Some(data) => {
                    data.push('\n');
                    data.push_str(value);
                }
                None => self.data = Some(value.to_owned()),
            },
            "event" => self.name = Some(value.to_owned()),
            _ => {} // `id`, `retry` and unknown fields mean nothing to these clients.
        }
        None
    }

    fn dispatch(&mut self) -> Option<SseEvent> {
        let name = self.name.take();
        let data = self.data.take()?;
        Some(SseEvent { name, data })
    }
}

/// Bytes asked for per read: a read returns what has arrived, and 16 KiB holds many
/// chunks, so a fast stream still takes one read per burst.
const READ_BUFFER_BYTES: usize = 16 * 1024;

/// A response body read as [`SseEvent`]s.
#[derive(Debug)]
pub struct SseStream<R> {
    body: R,
    parser: SseParser,
    buffer: Vec<u8>,
}

/// What one read of an [`SseStream`] gave.
#[derive(Debug)]
pub struct SseRead {
    /// The events the bytes read complete, in order.
    pub events: Vec<SseEvent>,
    /// When the read returned: the arrival of these events' last bytes.
    pub at: Instant,
    /// The body ended with this read (its events include one left without its empty
    /// line); later reads give nothing.
    pub ended: bool,
}

impl<R: Read> SseStream<R> {
    pub fn new(body: R) -> Self {
        Self {
            body,
            parser: SseParser::default(),
            buffer: vec![0; READ_BUFFER_BYTES],
        }
    }

    /// Reads what has arrived (waiting for at least one byte or the end).
    pub fn read(&mut self) -> std::io::Result<SseRead> {
        let read = self.body.read(&mut self.buffer);
        let at = Instant::now();
        let n = read?;
        let mut events = self.parser.push(&self.buffer[..n]);
        if n == 0 {
            events.extend(self.parser.finish());
        }
        Ok(SseRead {
            events,
            at,
            ended: n == 0,
        })
    }

    /// Reads the rest of the body and drops it, so that the connection can serve the next
    /// request. Errors are ignored: the events wanted have been read.
    pub fn drain(&mut self) {
        let _ = std::io::copy(&mut self.body, &mut std::io::sink());
    }
}

/// What one event of a completion stream says.
#[derive(Debug, Clone, PartialEq)]
pub enum StreamChunk {
    /// `data: [DONE]`: the stream is over.
    Done,
    /// An error event, or a chunk with an `error` object: the server's message.
    Error(String),
    /// A chunk of the completion.
    Delta {
        /// The text it adds (`choices[0].text`, or `choices[0].delta.content` for chat);
        /// empty for a chunk that only carries a role, usage or finish reason.
        text: String,
        /// How many tokens it carries, when the server says (`choices[0].token_ids`).
        tokens: Option<usize>,
        /// `usage.prompt_tokens` and `usage.completion_tokens`, when present.
        usage: Option<(usize, usize)>,
        finish_reason: Option<String>,
    },
}

/// Reads one event of a `/v1/completions` or `/v1/chat/completions` stream.
pub fn read_chunk(event: &SseEvent) -> StreamChunk {
    let data = event.data.trim();
    if data == "[DONE]" {
        return StreamChunk::Done;
    }
    let value: Value = match serde_json::from_str(data) {
        Ok(value) => value,
        Err(_) if event.name.as_deref() == Some("error") => {
            return StreamChunk::Error(data.to_owned());
        }
        Err(error) => {
            return StreamChunk::Error(format!("a stream event is not JSON ({error}): {data}"));
        }
    };
    if !value["error"].is_null() {
        let message = match &value["error"] {
            Value::String(message) => message.clone(),
            error => error["message"]
                .as_str()
                .map_or_else(|| error.to_string(), str::to_owned),
        };
        return StreamChunk::Error(message);
    }
    if event.name.as_deref() == Some("error") {
        return StreamChunk::Error(data.to_owned());
    }
    let choice = &value["choices"][0];
    let text = choice_text(choice).to_owned();
    let usage = &value["usage"];
    let usage = match (
        usage["prompt_tokens"].as_u64(),
        usage["completion_tokens"].as_u64(),
    ) {
        (Some(prompt), Some(completion)) => Some((prompt as usize, completion as usize)),
        _ => None,
    };
    StreamChunk::Delta {
        text,
        tokens: choice["token_ids"].as_array().map(Vec::len),
        usage,
        finish_reason: choice["finish_reason"].as_str().map(str::to_owned),
    }
}

/// The text a chunk's choice adds: `text` for a completion, `delta.content` for a chat;
/// empty when it has neither.
pub fn choice_text(choice: &Value) -> &str {
    choice["text"]
        .as_str()
        .or_else(|| choice["delta"]["content"].as_str())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(text: &str) -> SseEvent {
        SseEvent {
            name: None,
            data: text.to_owned(),
        }
    }

    #[test]
    fn events_split_across_reads_come_out_whole() {
        let body = "data: {\"a\":1}\n\n: ping\n\ndata: {\"b\":2}\r\n\r\ndata: [DONE]\n\n";
        // Every split point, including inside `\r\n` and inside a field name.
        for split in 0..body.len() {
            let mut parser = SseParser::default();
            let mut events = parser.push(&body.as_bytes()[..split]);
            events.extend(parser.push(&body.as_bytes()[split..]));
            assert_eq!(parser.finish(), None, "split at {split}");
            assert_eq!(
                events,
                [data("{\"a\":1}"), data("{\"b\":2}"), data("[DONE]")],
                "split at {split}"
            );
        }
        // One byte at a time.
        let mut parser = SseParser::default();
        let events: Vec<SseEvent> = body.bytes().flat_map(|b| parser.push(&[b])).collect();
        assert_eq!(events.len(), 3);
    }

    #[test]
    fn a_stream_gives_its_events_then_its_end() {
        let body = "data: {\"a\":1}\n\ndata: [DONE]";
        let mut stream = SseStream::new(body.as_bytes());
        let first = stream.read().expect("read");
        assert_eq!(
            (first.events, first.ended),
            (vec![data("{\"a\":1}")], false)
        );
        // The last event has no empty line: the end of the body completes it.
        let last = stream.read().expect("read");
        assert_eq!((last.events, last.ended), (vec![data("[DONE]")], true));
        assert!(last.at >= first.at);
        let after = stream.read().expect("read");
        assert!(after.events.is_empty() && after.ended);
    }

    #[test]
    fn multi_line_data_joins_and_event_names_are_kept() {
        let mut parser = SseParser::default();
        let events = parser.push(b"event: error\ndata: first\ndata:second\nid: 7\n\n");
        assert_eq!(
            events,
            [SseEvent {
                name: Some("error".into()),
                data: "first\nsecond".into()
            }]
        );
        // A body that ends without the final empty line still gives its event.
        assert!(parser.push(b"data: [DONE]").is_empty());
        assert_eq!(parser.finish(), Some(data("[DONE]")));
        assert_eq!(parser.finish(), None);
    }

    #[test]
    fn chunks_give_text_usage_and_errors() {
        assert_eq!(read_chunk(&data("[DONE]")), StreamChunk::Done);
        let completion =
            data(r#"{"choices":[{"index":0,"text":" the","token_ids":[5],"finish_reason":null}]}"#);
        assert_eq!(
            read_chunk(&completion),
            StreamChunk::Delta {
                text: " the".into(),
                tokens: Some(1),
                usage: None,
                finish_reason: None
            }
        );
        let chat =
            data(r#"{"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":"stop"}]}"#);
        let StreamChunk::Delta {
            text,
            finish_reason,
            ..
        } = read_chunk(&chat)
        else {
            panic!("a delta");
        };
        assert_eq!(
            (text.as_str(), finish_reason.as_deref()),
            ("Hi", Some("stop"))
        );
        let usage = data(r#"{"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":4}}"#);
        let StreamChunk::Delta { text, usage, .. } = read_chunk(&usage) else {
            panic!("a delta");
        };
        assert_eq!((text.as_str(), usage), ("", Some((12, 4))));
        let error = data(r#"{"error":{"message":"shard 1 failed","type":"unavailable"}}"#);
        assert_eq!(
            read_chunk(&error),
            StreamChunk::Error("shard 1 failed".into())
        );
        let named = SseEvent {
            name: Some("error".into()),
            data: "overloaded".into(),
        };
        assert_eq!(read_chunk(&named), StreamChunk::Error("overloaded".into()));
        let StreamChunk::Error(message) = read_chunk(&data("{not json")) else {
            panic!("an error");
        };
        assert!(message.contains("not JSON"), "{message}");
    }
}
