//! Unit tests of the analyser. The exact tokenizer here is a byte-level BPE with no merges: every
//! UTF-8 byte is one token and each added special token is one token, so expected counts are
//! byte lengths (cross-checks against the Python `tokenizers` package with a trained BPE are in
//! `tests/analyze/`).

use proptest::prelude::*;

use super::*;

const SPECIALS: [&str; 4] = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"];

fn byte_tokenizer_json() -> String {
    let alphabet = tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet();
    let mut chars: Vec<char> = alphabet.into_iter().collect();
    chars.sort_unstable();
    let vocab: serde_json::Map<String, Value> = chars
        .iter()
        .enumerate()
        .map(|(i, c)| (c.to_string(), Value::from(i)))
        .collect();
    let added: Vec<Value> = SPECIALS
        .iter()
        .enumerate()
        .map(|(i, s)| {
            serde_json::json!({"id": 256 + i, "content": s, "single_word": false, "lstrip": false,
                               "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    serde_json::json!({
        "version": "1.0",
        "truncation": {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0},
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [256], "tokens": ["<s>"]}}
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": []}
    })
    .to_string()
}

const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}{% if tools %}<|im_start|>tools\n{{ tools | tojson }}<|im_end|>\n{% endif %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

fn cfg(window: u64) -> AnalyzerConfig {
    AnalyzerConfig::new("m", window)
}

fn exact(window: u64) -> RequestAnalyzer {
    RequestAnalyzer::new(
        cfg(window),
        Counter::from_json(&byte_tokenizer_json()).unwrap(),
        None,
    )
    .unwrap()
}

fn templated(window: u64, template: &str) -> RequestAnalyzer {
    let tpl = ChatTemplate::new(template, None, Some("<s>".into()), Some("</s>".into())).unwrap();
    RequestAnalyzer::new(
        cfg(window),
        Counter::from_json(&byte_tokenizer_json()).unwrap(),
        Some(tpl),
    )
    .unwrap()
}

fn chat(a: &RequestAnalyzer, body: &Value) -> Result<Analysis, AnalysisError> {
    a.analyze("/v1/chat/completions", body.to_string().as_bytes())
}

fn err_of(r: Result<Analysis, AnalysisError>) -> AnalysisError {
    r.expect_err("expected a refusal")
}

#[test]
fn routes_parse_with_or_without_prefix() {
    assert_eq!(Route::parse("/v1/chat/completions"), Some(Route::Chat));
    assert_eq!(Route::parse("/chat/completions/"), Some(Route::Chat));
    assert_eq!(
        Route::parse("/v1/completions?x=1"),
        Some(Route::Completions)
    );
    assert_eq!(Route::parse("/v1/embeddings"), Some(Route::Embeddings));
    assert_eq!(Route::parse("/v1/models"), None);
    let e = err_of(exact(100).analyze("/v1/models", b"{}"));
    assert_eq!((e.status, e.code), (404, Some("unknown_url")));
}

fn responses(a: &RequestAnalyzer, body: &Value) -> Result<Analysis, AnalysisError> {
    a.analyze("/v1/responses", body.to_string().as_bytes())
}

#[test]
fn responses_count_as_the_chat_they_render_as() {
    assert_eq!(Route::parse("/v1/responses"), Some(Route::Responses));
    for a in [exact(4096), templated(4096, CHATML)] {
        // a string input is one user message; instructions a system message
        let r = responses(
            &a,
            &serde_json::json!({"model": "m", "input": "hello there", "instructions": "be brief",
                                "max_output_tokens": 50, "stream": true}),
        )
        .unwrap();
        let c = chat(
            &a,
            &serde_json::json!({"model": "m", "max_tokens": 50, "messages": [
                {"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]}),
        )
        .unwrap();
        assert_eq!(r.route, Route::Responses);
        assert_eq!(
            (r.prompt_tokens, r.completion_tokens),
            (c.prompt_tokens, 50)
        );
        assert_eq!(r.reserved_tokens, c.prompt_tokens + 50);
        assert!(r.stream && !r.include_usage);
        assert_eq!(r.n, 1);
        // items: input_text / output_text parts, a developer message, tools (flat → nested)
        let r = responses(
            &a,
            &serde_json::json!({"model": "m", "max_output_tokens": 7, "input": [
                {"role": "developer", "content": "rules"},
                {"type": "message", "role": "user", "content": [
                    {"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
                {"role": "assistant", "content": [{"type": "output_text", "text": "c"}]}],
                "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]}),
        )
        .unwrap();
        let c = chat(
            &a,
            &serde_json::json!({"model": "m", "max_tokens": 7, "messages": [
                {"role": "system", "content": "rules"},
                {"role": "user", "content": "a\nb"},
                {"role": "assistant", "content": "c"}],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}),
        )
        .unwrap();
        assert_eq!(r.prompt_tokens, c.prompt_tokens);
    }
}

#[test]
fn responses_reserve_like_chat_and_refuse_with_their_field_names() {
    let a = exact(100);
    // no max_output_tokens: the rest of the window, as chat without max_tokens
    let r = responses(&a, &serde_json::json!({"model": "m", "input": "hi"})).unwrap();
    assert_eq!(r.completion_tokens, 100 - r.prompt_tokens);
    assert_eq!(r.inject_max_tokens, None);
    let mut with_default = cfg(100);
    with_default.default_max_tokens = Some(10);
    let d = RequestAnalyzer::new(with_default, Counter::Estimate, None).unwrap();
    let r = responses(&d, &serde_json::json!({"model": "m", "input": "hi"})).unwrap();
    assert_eq!((r.completion_tokens, r.inject_max_tokens), (10, Some(10)));
    // context check
    let e = err_of(responses(
        &a,
        &serde_json::json!({"model": "m", "input": "hi", "max_output_tokens": 100}),
    ));
    assert_eq!((e.status, e.code), (400, Some("context_length_exceeded")));
    for (body, param, code) in [
        (
            serde_json::json!({"model": "m"}),
            "input",
            "missing_required_parameter",
        ),
        (
            serde_json::json!({"model": "m", "input": 3}),
            "input",
            "invalid_type",
        ),
        (
            serde_json::json!({"model": "m", "input": []}),
            "input",
            "empty_array",
        ),
        (
            serde_json::json!({"model": "m", "input": [1]}),
            "input[0]",
            "invalid_type",
        ),
        (
            serde_json::json!({"model": "m", "input": [{"role": "user", "content": [{"type": "input_text"}]}]}),
            "input[0].content[0].text",
            "missing_required_parameter",
        ),
        (
            serde_json::json!({"model": "m", "input": [{"role": "user", "content": [{"type": "nope"}]}]}),
            "input[0].content[0].type",
            "invalid_value",
        ),
        (
            serde_json::json!({"model": "m", "input": "x", "max_output_tokens": 0}),
            "max_output_tokens",
            "integer_below_min_value",
        ),
        (
            serde_json::json!({"model": "m", "input": "x", "instructions": 1}),
            "instructions",
            "invalid_type",
        ),
    ] {
        let e = err_of(responses(&a, &body));
        assert_eq!(
            (e.param.as_deref(), e.code),
            (Some(param), Some(code)),
            "{body}"
        );
    }
    // tool-call items are counted (name and arguments, the tool's output)
    let a = exact(1000);
    let bare = responses(&a, &serde_json::json!({"model": "m", "input": "q"})).unwrap();
    let calls = responses(
        &a,
        &serde_json::json!({"model": "m", "input": [
            {"role": "user", "content": "q"},
            {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": "{\"k\":1}"},
            {"type": "function_call_output", "call_id": "c1", "output": "result text"}]}),
    )
    .unwrap();
    assert!(calls.prompt_tokens > bare.prompt_tokens + 20, "{calls:?}");
}

#[test]
fn truncation_in_tokenizer_json_is_disabled() {
    // The file asks for truncation at 8 tokens; the count must not be capped.
    let a = exact(1000);
    let r = chat(&a, &serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "x".repeat(50)}]}))
        .unwrap();
    assert_eq!(r.prompt_tokens, 50 + 4);
}

#[test]
fn chat_overhead_counts_content_plus_overhead() {
    let a = exact(1000);
    let body = serde_json::json!({"model": "m", "messages": [
        {"role": "system", "content": "ab"},
        {"role": "user", "content": "cdé", "name": "bob"},
    ]});
    let r = chat(&a, &body).unwrap();
    // 2 + 4 bytes of content, 3 of name, 2 × 4 overhead.
    assert_eq!(r.prompt_tokens, 2 + 4 + 3 + 8);
    assert_eq!(r.counting, Counting::Overhead);
    assert_eq!(r.n, 1);
    assert_eq!(r.completion_tokens, 1000 - r.prompt_tokens);
    assert_eq!(r.reserved_tokens, 1000);
    assert_eq!(r.inject_max_tokens, None);
    assert!(!r.stream && !r.include_usage);
}

#[test]
fn chat_tools_tool_calls_and_media_are_counted() {
    let a = exact(10_000);
    let tools = serde_json::json!([{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": 2}}}]);
    let calls = serde_json::json!([{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\":1}"}}]);
    let body = serde_json::json!({"model": "m", "tools": tools, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "data:"}},
                                     {"type": "text", "text": "yo"}, {"type": "input_audio", "input_audio": {"data": ""}}]},
        {"role": "assistant", "content": null, "tool_calls": calls},
    ]});
    let r = chat(&a, &body).unwrap();
    let tools_len = serde_json::to_string(&tools).unwrap().len() as u64;
    let calls_len = serde_json::to_string(&calls).unwrap().len() as u64;
    // Key order is kept ("b" before "a") since tools are counted as sent.
    assert!(serde_json::to_string(&tools)
        .unwrap()
        .contains(r#"{"b":1,"a":2}"#));
    assert_eq!(
        r.prompt_tokens,
        5 + 765 + 200 + calls_len + tools_len + 2 * 4
    );
}

#[test]
fn chat_template_renders_and_counts_without_extra_specials() {
    let a = templated(1000, CHATML);
    let body = serde_json::json!({"model": "m", "messages": [
        {"role": "system", "content": "ab"}, {"role": "user", "content": "c"}]});
    let r = chat(&a, &body).unwrap();
    // <|im_start|> system \n ab <|im_end|> \n  = 1+6+1+2+1+1 ; user: 1+4+1+1+1+1 ; gen: 1+9+1
    assert_eq!(r.prompt_tokens, 12 + 9 + 11);
    assert_eq!(r.counting, Counting::ChatTemplate);
}

#[test]
fn chat_template_sees_tools_in_body_order_with_python_json_style() {
    let a = templated(10_000, CHATML);
    let body = serde_json::json!({"model": "m", "tools": [{"b": "<&>", "a": [1, 2.5]}],
        "messages": [{"role": "user", "content": "c"}]});
    let r = chat(&a, &body).unwrap();
    let tools_json = r#"[{"b": "<&>", "a": [1, 2.5]}]"#; // json.dumps(ensure_ascii=False)
    assert_eq!(
        r.prompt_tokens,
        9 + 11 + (1 + 5 + 1 + tools_json.len() as u64 + 1 + 1)
    );
}

#[test]
fn chat_template_raise_exception_is_a_400() {
    let a = templated(1000, "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}x");
    let e = err_of(chat(
        &a,
        &serde_json::json!({"model": "m", "messages": [{"role": "system", "content": "s"}]}),
    ));
    assert_eq!(
        (e.status, e.code, e.param.as_deref()),
        (400, Some("chat_template_error"), Some("messages"))
    );
    assert_eq!(e.message, "first message must be from the user");
}

#[test]
fn chat_template_python_methods_and_tool_call_arguments() {
    let tpl = "{% for m in messages %}{{ m.content.strip().upper() }}|{% if m.tool_calls %}{{ m.tool_calls[0].function.arguments.get('x') }}{% endif %}{% if m.get('name', 'none') == 'none' %}N{% endif %}{% endfor %}";
    let a = templated(1000, tpl);
    let body = serde_json::json!({"model": "m", "messages": [
        {"role": "user", "content": "  ab "},
        {"role": "assistant", "content": "c", "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 7}"}}]}]});
    // "AB|N" + "C|7N"
    assert_eq!(chat(&a, &body).unwrap().prompt_tokens, 8);
}

#[test]
fn tokenizer_config_list_and_added_token_objects() {
    let cfg = serde_json::json!({
        "bos_token": {"content": "<s>", "special": true}, "eos_token": "</s>",
        "chat_template": [{"name": "default", "template": "{{ bos_token }}D"}, {"name": "tool_use", "template": "{{ eos_token }}T"}]
    });
    let tpl = ChatTemplate::from_tokenizer_config(Some(&cfg.to_string()), None)
        .unwrap()
        .unwrap();
    let msgs = minijinja::Value::from(Vec::<minijinja::Value>::new());
    assert_eq!(tpl.render(msgs.clone(), None).unwrap(), "<s>D");
    assert_eq!(
        tpl.render(msgs, Some(minijinja::Value::from(1))).unwrap(),
        "</s>T"
    );
    assert!(ChatTemplate::from_tokenizer_config(Some("{}"), None)
        .unwrap()
        .is_none());
    assert!(ChatTemplate::from_tokenizer_config(Some("{"), None).is_err());
    assert!(ChatTemplate::new("{% for %}", None, None, None).is_err());
}

#[test]
fn strftime_formats_a_known_instant() {
    // 2024-07-26 13:05:09 UTC
    assert_eq!(
        chat::format_time("%d %b %Y %H:%M:%S %B %y %m %%", 1_722_099_109 - 86_400),
        "26 Jul 2024 16:51:49 July 24 07 %" /* = Python strftime */
    );
}

#[test]
fn max_tokens_fields_and_n() {
    let a = exact(1000);
    let msgs = serde_json::json!([{"role": "user", "content": "abcd"}]);
    let r = chat(
        &a,
        &serde_json::json!({"model": "m", "messages": msgs, "max_tokens": 10, "n": 3,
        "stream": true, "stream_options": {"include_usage": true}}),
    )
    .unwrap();
    assert_eq!(
        (r.prompt_tokens, r.completion_tokens, r.n, r.reserved_tokens),
        (8, 30, 3, 38)
    );
    assert!(r.stream && r.include_usage);
    // max_completion_tokens wins over max_tokens on chat; the other key is to be dropped.
    let r = chat(&a, &serde_json::json!({"model": "m", "messages": msgs, "max_tokens": 10, "max_completion_tokens": 5})).unwrap();
    assert_eq!((r.completion_tokens, r.drop_cap), (5, Some("max_tokens")));
    let r = chat(&a, &serde_json::json!({"model": "m", "messages": msgs, "max_tokens": 10, "max_completion_tokens": null})).unwrap();
    assert_eq!(
        (r.completion_tokens, r.drop_cap),
        (10, Some("max_completion_tokens"))
    );
    let r = chat(
        &a,
        &serde_json::json!({"model": "m", "messages": msgs, "max_completion_tokens": 7}),
    )
    .unwrap();
    assert_eq!((r.completion_tokens, r.drop_cap), (7, None));
    // on the legacy completions route max_tokens is the field
    let r = a
        .analyze(
            "/v1/completions",
            br#"{"model": "m", "prompt": "ab", "max_tokens": 10, "max_completion_tokens": 5}"#,
        )
        .unwrap();
    assert_eq!(
        (r.completion_tokens, r.drop_cap),
        (10, Some("max_completion_tokens"))
    );
    // null means absent.
    let r = chat(
        &a,
        &serde_json::json!({"model": "m", "messages": msgs, "max_tokens": null, "n": null}),
    )
    .unwrap();
    assert_eq!(r.completion_tokens, 1000 - 8);
}

#[test]
fn bad_field_types_name_the_param() {
    let a = exact(1000);
    let msgs = serde_json::json!([{"role": "user", "content": "abcd"}]);
    let cases: Vec<(Value, &str, &str)> = vec![
        (serde_json::json!("ten"), "max_tokens", "invalid_type"),
        (
            serde_json::json!(-1),
            "max_tokens",
            "integer_below_min_value",
        ),
        (
            serde_json::json!(0),
            "max_tokens",
            "integer_below_min_value",
        ),
        (serde_json::json!(1e12), "max_tokens", "invalid_type"),
        (serde_json::json!(10.0), "max_tokens", "invalid_type"),
        (serde_json::json!(true), "max_tokens", "invalid_type"),
        (
            serde_json::json!([1]),
            "max_completion_tokens",
            "invalid_type",
        ),
        (serde_json::json!(0), "n", "integer_below_min_value"),
        (serde_json::json!(129), "n", "integer_above_max_value"),
        (serde_json::json!(1e30), "n", "integer_above_max_value"),
        (
            serde_json::json!(1e30),
            "max_tokens",
            "integer_above_max_value",
        ),
        (
            serde_json::json!(1e30),
            "max_completion_tokens",
            "integer_above_max_value",
        ),
        (
            serde_json::json!(-1e30),
            "max_tokens",
            "integer_below_min_value",
        ),
        (
            serde_json::json!(crate::error::MAX_AMOUNT + 1),
            "max_tokens",
            "integer_above_max_value",
        ),
        (serde_json::json!("yes"), "stream", "invalid_type"),
    ];
    for (value, field, code) in cases {
        let mut body = serde_json::json!({"model": "m", "messages": msgs});
        body[field] = value.clone();
        let e = err_of(chat(&a, &body));
        assert_eq!(
            (e.status, e.kind),
            (400, error::INVALID_REQUEST),
            "{field}={value}"
        );
        assert_eq!(
            (e.param.as_deref(), e.code),
            (Some(field), Some(code)),
            "{field}={value}: {}",
            e.message
        );
    }
    let e = err_of(chat(
        &a,
        &serde_json::json!({"model": "m", "messages": msgs, "max_tokens": "ten"}),
    ));
    assert_eq!(
        e.message,
        "Invalid type for 'max_tokens': expected an integer, but got a string instead."
    );
    let e = err_of(chat(
        &a,
        &serde_json::json!({"model": "m", "messages": msgs, "stream_options": {"include_usage": 1}}),
    ));
    assert_eq!(e.param.as_deref(), Some("stream_options.include_usage"));
}

#[test]
fn bad_messages() {
    let a = exact(1000);
    let cases: Vec<(Value, &str, &str)> = vec![
        (
            serde_json::json!({"model": "m"}),
            "messages",
            "missing_required_parameter",
        ),
        (
            serde_json::json!({"model": "m", "messages": null}),
            "messages",
            "invalid_type",
        ),
        (
            serde_json::json!({"model": "m", "messages": []}),
            "messages",
            "empty_array",
        ),
        (
            serde_json::json!({"model": "m", "messages": "hi"}),
            "messages",
            "invalid_type",
        ),
        (
            serde_json::json!({"model": "m", "messages": [1]}),
            "messages[0]",
            "invalid_type",
        ),
        (
            serde_json::json!({"model": "m", "messages": [{"content": "x"}]}),
            "messages[0].role",
            "missing_required_parameter",
        ),
        (
            serde_json::json!({"model": "m", "messages": [{"role": "user"}]}),
            "messages[0].content",
            "missing_required_parameter",
        ),
        (
            serde_json::json!({"model": "m", "messages": [{"role": "user", "content": null}]}),
            "messages[0].content",
            "invalid_type",
        ),
        (
            serde_json::json!({"model": "m", "messages": [{"role": "user", "content": 5}]}),
            "messages[0].content",
            "invalid_type",
        ),
        (
            serde_json::json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "video"}]}]}),
            "messages[0].content[0].type",
            "invalid_value",
        ),
        (
            serde_json::json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}]}]}),
            "messages[0].content[0].text",
            "missing_required_parameter",
        ),
        (
            serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "x", "name": 3}]}),
            "messages[0].name",
            "invalid_type",
        ),
        (
            serde_json::json!({"model": "m", "messages": [{"role": "assistant", "tool_calls": {}}]}),
            "messages[0].tool_calls",
            "invalid_type",
        ),
        (
            serde_json::json!({"model": null, "messages": [{"role": "user", "content": "x"}]}),
            "model",
            "invalid_type",
        ),
        (
            serde_json::json!({"messages": [{"role": "user", "content": "x"}]}),
            "model",
            "missing_required_parameter",
        ),
        (
            serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": {}}),
            "tools",
            "invalid_type",
        ),
    ];
    for (body, param, code) in cases {
        let e = err_of(chat(&a, &body));
        assert_eq!(
            (e.param.as_deref(), e.code),
            (Some(param), Some(code)),
            "{body}: {}",
            e.message
        );
    }
    // Empty messages message text, as OpenAI words it.
    let e = err_of(chat(&a, &serde_json::json!({"model": "m", "messages": []})));
    assert!(e.message.starts_with("Invalid 'messages': empty array."));
}

#[test]
fn context_window_checks_keep_openai_phrase() {
    let a = exact(20);
    let msgs = serde_json::json!([{"role": "user", "content": "abcdefgh"}]); // 12 tokens
    let e = err_of(chat(
        &a,
        &serde_json::json!({"model": "m", "messages": msgs, "max_tokens": 9}),
    ));
    assert_eq!(
        (e.status, e.code, e.param.as_deref()),
        (400, Some("context_length_exceeded"), Some("messages"))
    );
    assert_eq!(e.message, "This model's maximum context length is 20 tokens. However, you requested 21 tokens (12 in the messages, 9 in the completion). Please reduce the length of the messages or completion.");
    assert_eq!(
        chat(
            &a,
            &serde_json::json!({"model": "m", "messages": msgs, "max_tokens": 8})
        )
        .unwrap()
        .reserved_tokens,
        20
    );
    let a = exact(12);
    let e = err_of(chat(&a, &msgs_body(&msgs)));
    assert!(e.message.starts_with("This model's maximum context length is 12 tokens. However, your messages resulted in 12 tokens."), "{}", e.message);
    let body = e.body();
    assert_eq!(body["error"]["code"], "context_length_exceeded");
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert!(body["error"].as_object().unwrap().len() == 4);
}

fn msgs_body(msgs: &Value) -> Value {
    serde_json::json!({"model": "m", "messages": msgs})
}

#[test]
fn default_max_tokens_is_injected_and_capped() {
    let mut c = cfg(100);
    c.default_max_tokens = Some(50);
    let a =
        RequestAnalyzer::new(c, Counter::from_json(&byte_tokenizer_json()).unwrap(), None).unwrap();
    let r = chat(
        &a,
        &serde_json::json!({"model": "m", "n": 2, "messages": [{"role": "user", "content": "ab"}]}),
    )
    .unwrap();
    assert_eq!(
        (r.prompt_tokens, r.completion_tokens, r.inject_max_tokens),
        (6, 100, Some(50))
    );
    let r = chat(&a, &serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "x".repeat(70)}]})).unwrap();
    assert_eq!(
        (r.prompt_tokens, r.completion_tokens, r.inject_max_tokens),
        (74, 26, Some(26))
    );
    let r = chat(&a, &serde_json::json!({"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "ab"}]})).unwrap();
    assert_eq!(r.inject_max_tokens, None);
    assert!(RequestAnalyzer::new(
        {
            let mut c = cfg(10);
            c.default_max_tokens = Some(0);
            c
        },
        Counter::Estimate,
        None
    )
    .is_err());
    assert!(RequestAnalyzer::new(cfg(0), Counter::Estimate, None).is_err());
}

#[test]
fn completions_prompt_forms() {
    let a = exact(100);
    let comp = |b: Value| a.analyze("/v1/completions", b.to_string().as_bytes());
    // A string gets the BOS from the post-processor.
    let r = comp(serde_json::json!({"model": "m", "prompt": "abc", "max_tokens": 5})).unwrap();
    assert_eq!(
        (r.prompt_tokens, r.completion_tokens, r.counting),
        (4, 5, Counting::Tokenizer)
    );
    let r =
        comp(serde_json::json!({"model": "m", "prompt": ["abc", "de"], "max_tokens": 5, "n": 2}))
            .unwrap();
    assert_eq!((r.prompt_tokens, r.completion_tokens), (7, 20));
    let r = comp(serde_json::json!({"model": "m", "prompt": [1, 2, 3], "max_tokens": 5, "n": 1, "best_of": 3})).unwrap();
    assert_eq!((r.prompt_tokens, r.completion_tokens, r.n), (3, 15, 3));
    let r = comp(serde_json::json!({"model": "m", "prompt": [[1, 2], [3]]})).unwrap();
    assert_eq!((r.prompt_tokens, r.completion_tokens), (3, 98 + 99));
    for (prompt, code) in [
        (serde_json::json!([]), "empty_array"),
        (serde_json::json!([[]]), "empty_array"),
        (serde_json::json!([1, "a"]), "invalid_value"),
        (serde_json::json!(["a", 1]), "invalid_type"),
        (serde_json::json!([-1]), "invalid_value"),
        (serde_json::json!([260]), "invalid_value"),
        (serde_json::json!([1.5]), "invalid_value"),
        (serde_json::json!(null), "invalid_type"),
        (serde_json::json!({"a": 1}), "invalid_type"),
        (serde_json::json!([true]), "invalid_type"),
    ] {
        let e = err_of(comp(serde_json::json!({"model": "m", "prompt": prompt})));
        assert_eq!(
            (e.param.as_deref(), e.code),
            (Some("prompt"), Some(code)),
            "{prompt}: {}",
            e.message
        );
    }
    let e = err_of(comp(
        serde_json::json!({"model": "m", "prompt": "a", "n": 3, "best_of": 2}),
    ));
    assert_eq!(e.param.as_deref(), Some("best_of"));
    let e = err_of(comp(
        serde_json::json!({"model": "m", "prompt": [[1], vec![1; 100]], "max_tokens": 1}),
    ));
    assert!(
        e.message
            .contains("(100 in the prompt, 1 in the completion)"),
        "{}",
        e.message
    );
}

#[test]
fn embeddings_input_forms() {
    let a = exact(10);
    let emb = |b: Value| a.analyze("/v1/embeddings", b.to_string().as_bytes());
    let r =
        emb(serde_json::json!({"model": "m", "input": ["ab", "c"], "stream": "ignored"})).unwrap();
    assert_eq!(
        (r.prompt_tokens, r.completion_tokens, r.reserved_tokens, r.n),
        (5, 0, 5, 1)
    );
    assert_eq!(
        emb(serde_json::json!({"model": "m", "input": [[1, 2], [3]]}))
            .unwrap()
            .prompt_tokens,
        3
    );
    let e = err_of(emb(
        serde_json::json!({"model": "m", "input": "x".repeat(10)}),
    ));
    assert_eq!(
        (e.param.as_deref(), e.code),
        (Some("input"), Some("context_length_exceeded"))
    );
    for input in [
        serde_json::json!(""),
        serde_json::json!(["a", ""]),
        serde_json::json!(vec!["a"; 2049]),
    ] {
        let e = err_of(emb(serde_json::json!({"model": "m", "input": input})));
        assert_eq!(
            (e.param.as_deref(), e.code),
            (Some("input"), Some("invalid_value"))
        );
    }
    let e = err_of(emb(serde_json::json!({"model": "m"})));
    assert_eq!(e.code, Some("missing_required_parameter"));
}

#[test]
fn malformed_bodies_are_400_invalid_json() {
    let a = exact(1000);
    let deep_array = "[".repeat(100_000);
    let deep_object = format!(
        "{{\"model\": \"m\", \"messages\": {}{}",
        "[".repeat(200),
        "]".repeat(200)
    );
    let ws = format!("{}{}", " ".repeat(131_072), "");
    let cases: Vec<&[u8]> = vec![
        b"",
        b"{",
        b"not json",
        b"{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"\xff\xfe\"}]}",
        deep_array.as_bytes(),
        deep_object.as_bytes(),
        ws.as_bytes(),
    ];
    for body in cases {
        let e = err_of(a.analyze("/v1/chat/completions", body));
        assert_eq!(
            (e.status, e.code, e.param),
            (400, Some("invalid_json"), None),
            "{}",
            e.message
        );
    }
    let e = err_of(a.analyze("/v1/chat/completions", b"[1, 2]"));
    assert_eq!((e.status, e.code), (400, Some("invalid_type")));
    // Paired surrogate escapes are fine (an emoji).
    let r = a
        .analyze(
            "/v1/chat/completions",
            br#"{"model":"m","messages":[{"role":"user","content":"\ud83d\ude00"}]}"#,
        )
        .unwrap();
    assert_eq!(r.prompt_tokens, 4 + 4);
}

#[test]
fn whitespace_content_of_128k_chars_is_counted() {
    let a = exact(1_000_000);
    let body = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": " ".repeat(131_072)}]});
    assert_eq!(chat(&a, &body).unwrap().prompt_tokens, 131_072 + 4);
    // And padding around a valid body is accepted.
    let padded = format!(
        "{}{}{}",
        " \n\t".repeat(43_000),
        msgs_body(&serde_json::json!([{"role": "user", "content": "a"}])),
        " ".repeat(1000)
    );
    assert!(a.analyze("/v1/chat/completions", padded.as_bytes()).is_ok());
}

#[test]
fn body_cap_model_and_registry() {
    let mut c = cfg(1000);
    c.max_body_bytes = 100;
    let small = Arc::new(RequestAnalyzer::new(c, Counter::Estimate, None).unwrap());
    let big = Arc::new(
        RequestAnalyzer::new(AnalyzerConfig::new("big", 1000), Counter::Estimate, None).unwrap(),
    );
    let long = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "x".repeat(200)}]}).to_string();
    let e = err_of(small.analyze("/v1/chat/completions", long.as_bytes()));
    assert_eq!((e.status, e.code), (413, Some("request_too_large")));
    let e = err_of(big.analyze("/v1/chat/completions", long.as_bytes()));
    assert_eq!(
        (e.status, e.code, e.param.as_deref()),
        (404, Some("model_not_found"), Some("model"))
    );

    let mut reg = ModelRegistry::new();
    reg.insert(small.clone());
    reg.insert(big);
    assert_eq!(reg.models(), vec!["big".to_owned(), "m".to_owned()]);
    assert_eq!(reg.max_body_bytes(), DEFAULT_MAX_BODY_BYTES);
    assert_eq!(
        err_of(reg.analyze("/v1/chat/completions", long.as_bytes())).status,
        413
    );
    let short =
        msgs_body(&serde_json::json!([{"role": "user", "content": "abcdefgh"}])).to_string();
    let r = reg
        .analyze("/v1/chat/completions", short.as_bytes())
        .unwrap();
    assert_eq!(
        (r.model.as_str(), r.prompt_tokens, r.counting),
        ("m", 2 + 4, Counting::Estimate)
    );
    let e = err_of(reg.analyze(
        "/v1/chat/completions",
        br#"{"model": "nope", "messages": []}"#,
    ));
    assert_eq!((e.status, e.code), (404, Some("model_not_found")));
    assert!(e.message.contains("`nope`"));

    assert!(check_content_length(None, 10).is_ok());
    assert!(check_content_length(Some(10), 10).is_ok());
    let e = check_content_length(Some(128 * 1024 * 1024), 10).unwrap_err();
    assert_eq!((e.status, e.code), (413, Some("request_too_large")));
    assert_eq!(e.to_json(), br#"{"error":{"message":"Request body too large: 134217728 bytes, the limit is 10 bytes.","type":"invalid_request_error","param":null,"code":"request_too_large"}}"#);
}

#[test]
fn peek_model_reads_only_the_model() {
    assert_eq!(
        peek_model(br#"{"messages": [1, {"a": []}], "model": "x"}"#).unwrap(),
        "x"
    );
    assert_eq!(
        peek_model(br#"{"messages": []}"#).unwrap_err().code,
        Some("missing_required_parameter")
    );
    assert_eq!(
        peek_model(br#"{"model": 3}"#).unwrap_err().code,
        Some("invalid_type")
    );
    assert_eq!(peek_model(b"[1]").unwrap_err().code, Some("invalid_type"));
    // a repeated key: the last one, as the full analysis reads it
    assert_eq!(peek_model(br#"{"model":"a","model":"b"}"#).unwrap(), "b");
    assert_eq!(
        peek_model(br#"{"model":"a\u0041","x":{"model":1}}"#).unwrap(),
        "aA"
    );
    assert_eq!(peek_model(b"{").unwrap_err().code, Some("invalid_json"));
    assert_eq!(
        peek_model("[".repeat(10_000).as_bytes())
            .unwrap_err()
            .status,
        400
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(body in proptest::collection::vec(any::<u8>(), 0..512)) {
        let a = templated(1000, CHATML);
        for route in ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"] {
            let _ = a.analyze(route, &body);
        }
        let _ = peek_model(&body);
    }

    #[test]
    fn arbitrary_json_fields_never_panic(
        content in prop_oneof![
            any::<String>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<f64>().prop_map(|f| serde_json::json!(f)),
            Just(Value::Null),
            proptest::collection::vec(any::<String>().prop_map(|s| serde_json::json!({"type": "text", "text": s})), 0..3).prop_map(Value::from),
        ],
        max_tokens in prop_oneof![any::<i64>().prop_map(Value::from), any::<u64>().prop_map(Value::from), Just(Value::Null), any::<String>().prop_map(Value::from)],
        n in prop_oneof![any::<i64>().prop_map(Value::from), Just(Value::Null)],
        window in 1u64..100_000,
    ) {
        let a = exact(window);
        let body = serde_json::json!({"model": "m", "max_tokens": max_tokens, "n": n,
            "messages": [{"role": "user", "content": content.clone()}]});
        if let Ok(r) = chat(&a, &body) {
            prop_assert!(r.prompt_tokens < window);
            prop_assert_eq!(r.reserved_tokens, r.prompt_tokens + r.completion_tokens);
            prop_assert!(r.completion_tokens >= r.n);
        }
        let body = serde_json::json!({"model": "m", "max_tokens": max_tokens, "prompt": content});
        let _ = a.analyze("/v1/completions", body.to_string().as_bytes());
    }
}

#[test]
fn count_equals_encoding_length() {
    let json = byte_tokenizer_json();
    let counter = Counter::from_json(&json).unwrap();
    let tok: tokenizers::Tokenizer = json.parse().unwrap();
    let long = "word 😀 <|im_start|> 请求 ".repeat(2000);
    for text in ["", "a", "x <s> y</s>", "日本語 😀\n\tcode()", long.as_str()] {
        for special in [false, true] {
            // The file's truncation (8) would cap the encoding; compare with it switched off.
            let mut untruncated = tok.clone();
            untruncated.with_truncation(None).unwrap();
            let full = untruncated.encode_fast(text, special).unwrap().len();
            assert_eq!(
                counter.count(text, special).unwrap(),
                full as u64,
                "{special} {text:.40}"
            );
        }
    }
}

#[test]
fn limits_past_what_the_core_accounts_are_refused() {
    let max = crate::error::MAX_AMOUNT;
    let counter = || Counter::from_json(&byte_tokenizer_json()).unwrap();
    assert!(RequestAnalyzer::new(cfg(max + 1), counter(), None).is_err());
    let mut c = cfg(1024);
    c.image_tokens = u64::MAX;
    assert!(RequestAnalyzer::new(c, counter(), None).is_err());
    // a window of 2**62 with n = 128 and no max_tokens: 128 × the window is past 2**62
    let a = RequestAnalyzer::new(cfg(max), counter(), None).unwrap();
    let body = serde_json::json!({"model": "m", "n": 128, "messages": [{"role": "user", "content": "hi"}]});
    let err = chat(&a, &body).unwrap_err();
    assert_eq!(err.status, 400);
    assert_eq!(err.param.as_deref(), Some("max_tokens"));
    assert!(err.message.contains("more than 2**62"), "{}", err.message);
    // within the bound: reserved as before
    let ok = chat(
        &a,
        &serde_json::json!({"model": "m", "max_tokens": 5, "n": 2,
        "messages": [{"role": "user", "content": "hi"}]}),
    )
    .unwrap();
    assert_eq!(ok.completion_tokens, 10);
}

#[test]
fn integers_too_large_for_64_bits_say_the_bound() {
    let a = exact(1000);
    for field in ["max_tokens", "max_completion_tokens", "n", "best_of"] {
        let body =
            format!(r#"{{"model": "m", "prompt": "x", "{field}": 99999999999999999999999}}"#);
        let e = err_of(a.analyze("/v1/completions", body.as_bytes()));
        assert_eq!(
            (e.status, e.param.as_deref(), e.code),
            (400, Some(field), Some("integer_above_max_value")),
            "{}",
            e.message
        );
        let max = if field.starts_with("max") {
            crate::error::MAX_AMOUNT
        } else {
            MAX_N
        };
        assert!(
            e.message.contains(&format!("Expected a value <= {max}")),
            "{}",
            e.message
        );
        assert!(!e.message.contains("decimal"), "{}", e.message);
    }
    // a decimal in range is still a type error, as OpenAI answers
    let e = err_of(a.analyze(
        "/v1/completions",
        br#"{"model": "m", "prompt": "x", "max_tokens": 10.5}"#,
    ));
    assert_eq!(e.code, Some("invalid_type"));
}

#[test]
fn lone_surrogate_escapes_are_read_as_the_replacement_character() {
    let a = exact(1000);
    // U+FFFD is 3 UTF-8 bytes: 3 tokens with the byte tokenizer, + 4 overhead
    for (content, tokens) in [
        (r"\ud800", 3),
        (r"\udc00x", 4),
        (r"a\uD83Db", 5),
        (r"\ud83d\ud83d\ude00", 3 + 4),
        (r"\\ud800", 6),
        (r"\\\ud800", 1 + 3),
    ] {
        let body =
            format!(r#"{{"model":"m","messages":[{{"role":"user","content":"{content}"}}]}}"#);
        let r = a.analyze("/v1/chat/completions", body.as_bytes()).unwrap();
        assert_eq!(r.prompt_tokens, tokens + 4, "{content}");
        assert_eq!(peek_model(body.as_bytes()).unwrap(), "m");
    }
    assert_eq!(
        body::replace_lone_surrogates(br#"["\ud800", "\\ud800", "\ud83d\ude00", "\udfff"]"#)
            .unwrap(),
        br#"["\ufffd", "\\ud800", "\ud83d\ude00", "\ufffd"]"#.to_vec()
    );
    assert!(body::replace_lone_surrogates(br#"{"a": "\u00e9\n"}"#).is_none());
    // a body broken otherwise keeps its own error
    let e = err_of(a.analyze("/v1/chat/completions", br#"{"model": "m", "x": "\ud800"#));
    assert_eq!(e.code, Some("invalid_json"));
}

#[test]
fn chat_template_kwargs_and_generation_flags_reach_the_template() {
    let tpl = "{% for m in messages %}{{ m['content'] }}|{% endfor %}\
        {% if enable_thinking is defined and not enable_thinking %}<no_think>{% endif %}\
        {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{{ bos_token }}";
    let a = templated(1000, tpl);
    let msgs = serde_json::json!([{"role": "user", "content": "ab"}]);
    let count = |extra: Value| {
        let mut body = serde_json::json!({"model": "m", "messages": msgs});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        chat(&a, &body)
    };
    let base = count(serde_json::json!({})).unwrap().prompt_tokens;
    assert_eq!(base, 3 + 1 + 10 + 1); // "ab|" + im_start + "assistant\n" + <s>
    let off = count(serde_json::json!({"chat_template_kwargs": {"enable_thinking": false}}))
        .unwrap()
        .prompt_tokens;
    assert_eq!(off, base + "<no_think>".len() as u64);
    let no_gen = count(serde_json::json!({"add_generation_prompt": false}))
        .unwrap()
        .prompt_tokens;
    assert_eq!(no_gen, 3 + 1);
    // kwargs may replace bos_token (as transformers lets them), never messages
    let r =
        count(serde_json::json!({"chat_template_kwargs": {"bos_token": "xyz", "messages": []}}))
            .unwrap();
    assert_eq!(r.prompt_tokens, base - 1 + 3);
    let e = err_of(count(serde_json::json!({"chat_template_kwargs": [1]})));
    assert_eq!(
        (e.param.as_deref(), e.code),
        (Some("chat_template_kwargs"), Some("invalid_type"))
    );
    let e = err_of(count(serde_json::json!({"add_generation_prompt": "no"})));
    assert_eq!(e.param.as_deref(), Some("add_generation_prompt"));
    let e = err_of(count(
        serde_json::json!({"continue_final_message": true, "add_generation_prompt": true}),
    ));
    assert_eq!(
        (e.param.as_deref(), e.code),
        (Some("continue_final_message"), Some("invalid_value"))
    );
}

#[test]
fn continue_final_message_ends_the_prompt_after_the_last_message() {
    let a = templated(1000, CHATML);
    let body = serde_json::json!({"model": "m", "continue_final_message": true, "messages": [
        {"role": "user", "content": "c"}, {"role": "assistant", "content": " Once upon "}]});
    let r = chat(&a, &body).unwrap();
    // <|im_start|>user\nc<|im_end|>\n = 1+5+1+1+1 ; <|im_start|>assistant\n + "Once upon"
    assert_eq!(r.prompt_tokens, 9 + 1 + 10 + 1 + 9);
    // a template that drops the message's text cannot be continued
    let a = templated(1000, "{% for m in messages %}{{ m['role'] }}{% endfor %}");
    let e = err_of(chat(&a, &body));
    assert_eq!(
        (e.param.as_deref(), e.code),
        (Some("continue_final_message"), Some("chat_template_error"))
    );
}

#[test]
fn template_check_names_the_file_and_line() {
    let good = ChatTemplate::named("/t/chatml.jinja", CHATML, None, None, None).unwrap();
    assert!(good.check().is_ok());
    // refuses system messages on purpose: accepted (one user message renders)
    let picky = "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }}{% endfor %}";
    assert!(ChatTemplate::new(picky, None, None, None)
        .unwrap()
        .check()
        .is_ok());
    // adds a tool call's null content to a string (llama.cpp's plain ChatML): a type error on
    // the sample's data, not a broken template: accepted (one user message renders)
    let concat = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}";
    assert!(ChatTemplate::new(concat, None, None, None)
        .unwrap()
        .check()
        .is_ok());
    // refuses everything: refused, with the template's words
    let never = ChatTemplate::named(
        "/t/never.jinja",
        "{{ raise_exception('no') }}",
        None,
        None,
        None,
    )
    .unwrap();
    let e = never.check().unwrap_err();
    assert!(e.contains("/t/never.jinja") && e.contains("no"), "{e}");
    // an unknown method in the tool-call branch only: refused with file and line
    let broken = "{% for m in messages %}\n{% if m.tool_calls %}\n{{ m['content'].casefold() }}\n{% endif %}{% endfor %}";
    let e = ChatTemplate::named("/t/broken.jinja", broken, None, None, None)
        .unwrap()
        .check()
        .unwrap_err();
    assert!(e.contains("/t/broken.jinja:3"), "{e}");
    let e = ChatTemplate::named("/t/syntax.jinja", "a\n{% for %}", None, None, None)
        .err()
        .unwrap();
    assert!(e.contains("/t/syntax.jinja:2"), "{e}");
}

#[test]
fn long_texts_are_counted_in_segments_cut_between_words() {
    let text = "alpha beta, gamma 12 delta ".repeat(3000);
    let pieces = count::segments(&text, 1000);
    assert_eq!(pieces.concat(), text);
    for p in &pieces[1..] {
        assert!(p.len() <= 1000 && p.starts_with(' '), "{p:.20}");
    }
    // one unbroken run: cut at character boundaries
    let run = "é".repeat(5000);
    let pieces = count::segments(&run, 1001);
    assert_eq!(pieces.concat(), run);
    assert!(pieces.iter().all(|p| p.len() <= 1001 && !p.is_empty()));
    let a = exact(u64::MAX >> 2);
    let body = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "a".repeat(3_000_000)}]});
    assert_eq!(chat(&a, &body).unwrap().prompt_tokens, 3_000_000 + 4);
}
