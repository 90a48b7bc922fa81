use super::*;

#[test]
fn byte_table_matches_gpt2() {
    let table = bytes_to_unicode();
    assert_eq!(table[usize::from(b'A')], 'A');
    assert_eq!(table[usize::from(b' ')], '\u{120}'); // "Ġ"
    assert_eq!(table[usize::from(b'\n')], '\u{10a}'); // "Ċ"
    assert_eq!(table[0xad], '\u{143}');
    let distinct: HashSet<char> = table.iter().copied().collect();
    assert_eq!(distinct.len(), 256);
}

#[test]
fn merges_follow_score_then_length() {
    let tokens: Vec<String> = ["a", "b", "c", "ab", "bc", "abc"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let scores = [0.0, 0.0, 0.0, -1.0, -2.0, -3.0];
    let merges = merges_from_scores(&tokens, &scores);
    // Equal scores: the longer left half first.
    let expected = [("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc")];
    let expected: Vec<(String, String)> = expected
        .iter()
        .map(|(l, r)| (l.to_string(), r.to_string()))
        .collect();
    assert_eq!(merges, expected);
}

#[test]
fn bad_merge_names_the_key() {
    let err = parse_merges(&["a b c".to_string()]).unwrap_err();
    assert!(err.to_string().contains("tokenizer.ggml.merges"), "{err}");
}

#[test]
fn unknown_model_is_an_error() {
    let vocab = GgufVocab {
        model: "rwkv".to_string(),
        tokens: vec!["a".to_string()],
        ..GgufVocab::default()
    };
    let err = build(&vocab).unwrap_err();
    assert!(err.to_string().contains("rwkv"), "{err}");
}

/// A GGUF v3 file with no tensors and the given string metadata.
fn gguf_with_strings(entries: &[(&str, &str)]) -> tempfile::NamedTempFile {
    let mut bytes = b"GGUF".to_vec();
    bytes.extend(3u32.to_le_bytes());
    bytes.extend(0u64.to_le_bytes());
    bytes.extend((entries.len() as u64).to_le_bytes());
    for (key, value) in entries {
        bytes.extend((key.len() as u64).to_le_bytes());
        bytes.extend(key.as_bytes());
        bytes.extend(8u32.to_le_bytes()); // string
        bytes.extend((value.len() as u64).to_le_bytes());
        bytes.extend(value.as_bytes());
    }
    let mut file = tempfile::NamedTempFile::new().unwrap();
    std::io::Write::write_all(&mut file, &bytes).unwrap();
    file
}

#[test]
fn gguf_without_tokenizer_is_none() {
    let file = gguf_with_strings(&[("general.architecture", "llama")]);
    let gguf = GgufFile::open(file.path()).unwrap();
    assert_eq!(GgufVocab::from_gguf(&gguf).unwrap(), None);
}

#[test]
fn gguf_without_tokens_names_file_and_key() {
    let file = gguf_with_strings(&[("tokenizer.ggml.model", "gpt2")]);
    let gguf = GgufFile::open(file.path()).unwrap();
    let err = GgufVocab::from_gguf(&gguf).unwrap_err().to_string();
    let name = file.path().display().to_string();
    assert!(
        err.contains(&name) && err.contains("tokenizer.ggml.tokens"),
        "{err}"
    );
}

/// A SentencePiece vocabulary where "hi" and "▁hi" are both whole tokens.
fn spm_vocab(add_space_prefix: Option<bool>) -> GgufVocab {
    let tokens = [
        "<unk>",
        "<s>",
        "</s>",
        "\u{2581}",
        "h",
        "i",
        "hi",
        "\u{2581}hi",
    ];
    GgufVocab {
        model: "llama".to_string(),
        tokens: tokens.iter().map(|t| t.to_string()).collect(),
        scores: Some(vec![0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0]),
        token_types: Some(vec![2, 3, 3, 1, 1, 1, 1, 1]),
        bos_token_id: Some(1),
        eos_token_id: Some(2),
        unknown_token_id: Some(0),
        add_space_prefix,
        ..GgufVocab::default()
    }
}

#[test]
fn space_prefix_is_added_and_stripped_by_default() {
    let tok = build(&spm_vocab(None)).unwrap();
    assert_eq!(tok.encode("hi", true).unwrap().get_ids(), [1, 7]);
    assert_eq!(tok.encode("hi hi", false).unwrap().get_ids(), [7, 7]);
    assert_eq!(tok.decode(&[1, 7, 7], true).unwrap(), "hi hi");
}

#[test]
fn no_space_prefix_when_the_file_says_so() {
    let tok = build(&spm_vocab(Some(false))).unwrap();
    assert_eq!(tok.encode("hi hi", false).unwrap().get_ids(), [6, 7]);
    assert_eq!(tok.decode(&[7, 6], false).unwrap(), " hihi");
}

#[test]
fn out_of_range_bos_names_the_key() {
    let vocab = GgufVocab {
        model: "gpt2".to_string(),
        tokens: vec!["a".to_string()],
        bos_token_id: Some(7),
        ..GgufVocab::default()
    };
    let err = build(&vocab).unwrap_err();
    assert!(err.to_string().contains("bos_token_id"), "{err}");
}
