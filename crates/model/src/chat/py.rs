//! Python's formatting for chat templates: `str()`/`repr()` of values, `json.dumps` as
//! transformers' `tojson` calls it, and C `strftime` for `strftime_now`.
//!
//! Chat templates are Jinja written for Python: transformers renders them with jinja2, so a
//! template that prints `{{ true }}`, a list, a float or `tojson` output gets Python's text
//! (`True`, `['a', 1]`, `1.0`, `{"k": "v"}`), and the model was tuned on exactly that text.
//! minijinja prints values its own way, so this module reproduces Python's: the parent
//! module registers [`python_formatter`] as the environment's formatter, [`tojson`] as the
//! `tojson` filter and calls [`strftime`] from `strftime_now`. Nothing else uses it.

use std::fmt::Write as _;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Output, State, Value};

/// Prints values as Python's `str()` would: `True`, `None`, `['a', 1]`, `{'k': 'v'}`.
pub(super) fn python_formatter(
    out: &mut Output<'_>,
    state: &State<'_, '_>,
    value: &Value,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Bool
        | ValueKind::None
        | ValueKind::Seq
        | ValueKind::Iterable
        | ValueKind::Map => {
            let mut text = String::new();
            python_repr(&mut text, value, false)?;
            out.write_str(&text).map_err(Error::from)
        }
        _ => minijinja::escape_formatter(out, state, value),
    }
}

/// Python's `repr` (`quote_strings`) or `str` of a value.
fn python_repr(out: &mut String, value: &Value, quote_strings: bool) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => push_number(out, value),
        ValueKind::String if quote_strings => {
            let s = value.as_str().unwrap_or_default();
            let quote = if s.contains('\'') && !s.contains('"') {
                '"'
            } else {
                '\''
            };
            out.push(quote);
            for c in s.chars() {
                match c {
                    '\\' => out.push_str("\\\\"),
                    '\n' => out.push_str("\\n"),
                    '\r' => out.push_str("\\r"),
                    '\t' => out.push_str("\\t"),
                    c if c == quote => {
                        out.push('\\');
                        out.push(c);
                    }
                    c => out.push(c),
                }
            }
            out.push(quote);
        }
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            for (i, item) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_repr(out, &item, true)?;
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_repr(out, &key, true)?;
                out.push_str(": ");
                python_repr(out, &value.get_item(&key)?, true)?;
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{value}");
        }
    }
    Ok(())
}

/// A number as Python prints it (floats always with a `.` or an exponent).
fn push_number(out: &mut String, value: &Value) {
    if value.is_integer() {
        let _ = write!(out, "{value}");
        return;
    }
    match f64::try_from(value.clone()) {
        Ok(x) => out.push_str(&python_float(x)),
        Err(_) => {
            let _ = write!(out, "{value}");
        }
    }
}

/// Python's `repr(float)`: shortest round-trip digits, scientific below 1e-4 and from 1e16.
fn python_float(x: f64) -> String {
    if x.is_nan() {
        return "NaN".to_string();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.to_string();
    }
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if x != 0.0 && !(-4..16).contains(&exp) {
        let sign = if exp < 0 { '-' } else { '+' };
        return format!("{mantissa}e{sign}{:02}", exp.abs());
    }
    let plain = format!("{x}");
    if plain.contains('.') {
        plain
    } else {
        format!("{plain}.0")
    }
}

/// How `tojson` lays out its output.
struct JsonStyle {
    indent: Option<String>,
    item_separator: String,
    key_separator: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`.
pub(super) fn tojson(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match kwargs.get::<Option<Value>>("indent")?.or(indent) {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match (v.as_i64(), v.as_str()) {
            (Some(n), _) => Some(" ".repeat(usize::try_from(n).unwrap_or(0))),
            (None, Some(s)) => Some(s.to_string()),
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: bad indent",
                ));
            }
        },
    };
    let (item_separator, key_separator) = match kwargs.get::<Option<Vec<String>>>("separators")? {
        Some(seps) if seps.len() == 2 => (seps[0].clone(), seps[1].clone()),
        Some(_) => {
            let msg = "tojson: separators must be two strings";
            return Err(Error::new(ErrorKind::InvalidOperation, msg));
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let style = JsonStyle {
        indent,
        item_separator,
        key_separator,
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&mut out, value, &style, 0)?;
    Ok(Value::from_safe_string(out))
}

fn write_json(
    out: &mut String,
    value: &Value,
    style: &JsonStyle,
    depth: usize,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => push_number(out, value),
        ValueKind::String => write_json_string(out, value.as_str().unwrap_or_default(), style),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            write_json_items(out, style, depth, ('[', ']'), &items, |out, item| {
                write_json(out, item, style, depth + 1)
            })?;
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if style.sort_keys {
                keys.sort();
            }
            write_json_items(out, style, depth, ('{', '}'), &keys, |out, key| {
                match key.as_str() {
                    Some(s) => write_json_string(out, s, style),
                    None => write_json_string(out, &key.to_string(), style),
                }
                out.push_str(&style.key_separator);
                write_json(out, &value.get_item(key)?, style, depth + 1)
            })?;
        }
        kind => {
            let msg = format!("tojson: a value of kind {kind} is not JSON serializable");
            return Err(Error::new(ErrorKind::InvalidOperation, msg));
        }
    }
    Ok(())
}

/// Items between `brackets`, with Python's line breaks and indentation when indenting.
fn write_json_items(
    out: &mut String,
    style: &JsonStyle,
    depth: usize,
    brackets: (char, char),
    items: &[Value],
    mut write_item: impl FnMut(&mut String, &Value) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(brackets.0);
    if items.is_empty() {
        out.push(brackets.1);
        return Ok(());
    }
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push_str(&style.item_separator);
        }
        if let Some(indent) = &style.indent {
            out.push('\n');
            out.push_str(&indent.repeat(depth + 1));
        }
        write_item(out, item)?;
    }
    if let Some(indent) = &style.indent {
        out.push('\n');
        out.push_str(&indent.repeat(depth));
    }
    out.push(brackets.1);
    Ok(())
}

/// A JSON string as Python's `json.dumps` writes it.
fn write_json_string(out: &mut String, s: &str, style: &JsonStyle) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (style.ensure_ascii && !c.is_ascii()) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

const WEEKDAYS: [&str; 7] = [
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
];
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// A broken-down UTC time.
struct Civil {
    year: i64,
    month: usize,
    day: i64,
    weekday: usize,
    yday: i64,
    hour: i64,
    minute: i64,
    second: i64,
}

/// Year, month (1-12) and day of the `days`-th day after 1970-01-01 (proleptic Gregorian).
fn civil_from_days(days: i64) -> (i64, usize, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month as usize, day)
}

fn civil(unix_s: i64) -> Civil {
    let days = unix_s.div_euclid(86_400);
    let secs = unix_s.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    const BEFORE_MONTH: [i64; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = BEFORE_MONTH[month - 1] + day + i64::from(leap && month > 2);
    Civil {
        year,
        month,
        day,
        weekday: (days + 4).rem_euclid(7) as usize,
        yday,
        hour: secs / 3600,
        minute: secs / 60 % 60,
        second: secs % 60,
    }
}

/// C `strftime` for a UTC time: the common conversions, and glibc's `-` flag (no padding).
pub(super) fn strftime(format: &str, unix_s: i64) -> String {
    let t = civil(unix_s);
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut spec = chars.next();
        let pad = spec != Some('-');
        if !pad {
            spec = chars.next();
        }
        let num = |out: &mut String, n: i64, width: usize| {
            let _ = if pad {
                write!(out, "{n:0width$}")
            } else {
                write!(out, "{n}")
            };
        };
        let hour12 = if t.hour % 12 == 0 { 12 } else { t.hour % 12 };
        match spec {
            Some('Y') => num(&mut out, t.year, 1),
            Some('y') => num(&mut out, t.year.rem_euclid(100), 2),
            Some('m') => num(&mut out, t.month as i64, 2),
            Some('d') => num(&mut out, t.day, 2),
            Some('e') => {
                let _ = if pad {
                    write!(out, "{:2}", t.day)
                } else {
                    write!(out, "{}", t.day)
                };
            }
            Some('H') => num(&mut out, t.hour, 2),
            Some('I') => num(&mut out, hour12, 2),
            Some('M') => num(&mut out, t.minute, 2),
            Some('S') => num(&mut out, t.second, 2),
            Some('j') => num(&mut out, t.yday, 3),
            Some('p') => out.push_str(if t.hour < 12 { "AM" } else { "PM" }),
            Some('b' | 'h') => out.push_str(&MONTHS[t.month - 1][..3]),
            Some('B') => out.push_str(MONTHS[t.month - 1]),
            Some('a') => out.push_str(&WEEKDAYS[t.weekday][..3]),
            Some('A') => out.push_str(WEEKDAYS[t.weekday]),
            Some('w') => num(&mut out, t.weekday as i64, 1),
            Some('u') => num(
                &mut out,
                if t.weekday == 0 { 7 } else { t.weekday as i64 },
                1,
            ),
            Some('F') => out.push_str(&strftime("%Y-%m-%d", unix_s)),
            Some('T') => out.push_str(&strftime("%H:%M:%S", unix_s)),
            Some('D') => out.push_str(&strftime("%m/%d/%y", unix_s)),
            Some('R') => out.push_str(&strftime("%H:%M", unix_s)),
            Some('c') => out.push_str(&strftime("%a %b %e %H:%M:%S %Y", unix_s)),
            Some('x') => out.push_str(&strftime("%m/%d/%y", unix_s)),
            Some('X') => out.push_str(&strftime("%H:%M:%S", unix_s)),
            Some('Z') => out.push_str("UTC"),
            Some('z') => out.push_str("+0000"),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_known_dates() {
        // 2024-07-26 13:05:09 UTC, a Friday, day 208 of a leap year.
        let t = 1_722_000_000 - 1_722_000_000 % 86_400 + 13 * 3600 + 5 * 60 + 9;
        assert_eq!(strftime("%d %b %Y", t), "26 Jul 2024");
        assert_eq!(
            strftime("%A %B %-d, %H:%M:%S %j %p %I", t),
            "Friday July 26, 13:05:09 208 PM 01"
        );
        assert_eq!(strftime("%F %y %e %% %q", 0), "1970-01-01 70  1 % %q");
        assert_eq!(strftime("%Y-%m-%d %a", 951_782_400), "2000-02-29 Tue");
        assert_eq!(strftime("%Y-%m-%d", -86_400), "1969-12-31");
    }

    #[test]
    fn python_floats() {
        assert_eq!(python_float(1.0), "1.0");
        assert_eq!(python_float(2.5), "2.5");
        assert_eq!(python_float(1e-5), "1e-05");
        assert_eq!(python_float(1.5e20), "1.5e+20");
        assert_eq!(python_float(0.0001), "0.0001");
        assert_eq!(python_float(-0.0), "-0.0");
    }
}
