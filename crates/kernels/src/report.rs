//! Machine-readable benchmark figures: one `RESULT {json}` line per measured row, next to
//! the human table a benchmark prints. `scripts/gpu-report.py` collects them from
//! `scripts/gpu-check.sh`'s log into one table and one JSON file.

use std::fmt::Write as _;

/// A value of a result line.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Field<'a> {
    Text(&'a str),
    Number(f64),
}

/// `RESULT {"kind": kind, name: value, …}`: non-finite numbers become `null`, text is
/// escaped as JSON strings are.
pub fn result_line(kind: &str, fields: &[(&str, Field<'_>)]) -> String {
    let mut line = format!("RESULT {{\"kind\":{}", quoted(kind));
    for (name, value) in fields {
        let value = match value {
            Field::Text(text) => quoted(text),
            Field::Number(n) if n.is_finite() => format!("{n}"),
            Field::Number(_) => "null".to_string(),
        };
        let _ = write!(line, ",{}:{value}", quoted(name));
    }
    line.push('}');
    line
}

fn quoted(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_result_line_is_json_after_its_tag() {
        let line = result_line(
            "decode",
            &[
                ("batch", Field::Number(8.0)),
                ("tok_s", Field::Number(1234.5)),
                ("mode", Field::Text("graph \"x\"\n")),
                ("share", Field::Number(f64::NAN)),
            ],
        );
        assert_eq!(
            line,
            r#"RESULT {"kind":"decode","batch":8,"tok_s":1234.5,"mode":"graph \"x\"\u000a","share":null}"#
        );
    }
}
