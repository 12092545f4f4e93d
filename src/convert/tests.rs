use super::*;
use crate::fixture::{self, FixtureSpec, Layout, Preset};
use crate::model::{load_model, LoadOptions};

fn spec(mode: QuantMode, bits: i32, group_size: i32) -> QuantSpec {
    QuantSpec { mode, bits, group_size }
}

fn ov(s: &str) -> QuantOverride {
    QuantOverride::parse(s).unwrap()
}

fn recipe(q: QuantSpec, overrides: &[&str]) -> ConvertRecipe {
    ConvertRecipe { quant: Some(q), overrides: overrides.iter().map(|s| ov(s)).collect(), ..Default::default() }
}

#[test]
fn override_parsing() {
    assert_eq!(ov("feed_forward.gate=skip"), QuantOverride { pattern: "feed_forward.gate".into(), action: OverrideAction::Skip });
    assert_eq!(ov("x=SKIP").action, OverrideAction::Skip);
    assert_eq!(
        ov("feed_forward.gate=8").action,
        OverrideAction::Quantize { mode: None, bits: Some(8), group_size: None }
    );
    assert_eq!(
        ov(" *.v_proj = 8:32:mxfp8 ").action,
        OverrideAction::Quantize { mode: Some(QuantMode::Mxfp8), bits: Some(8), group_size: Some(32) }
    );
    assert_eq!(ov("a=6:128").action, OverrideAction::Quantize { mode: None, bits: Some(6), group_size: Some(128) });
    for (bad, why) in [
        ("feed_forward.gate", "no `=`"),
        ("=8", "pattern is empty"),
        ("a=eight", "bits `eight`"),
        ("a=4:0", "group size `0`"),
        ("a=4:32:fp4", "mode `fp4` is unknown"),
        ("a=4:32:affine:1", "too many"),
    ] {
        let e = QuantOverride::parse(bad).unwrap_err();
        assert!(e.message.contains(why) && e.message.contains(bad), "{bad}: {}", e.message);
    }
}

#[test]
fn override_resolution_takes_defaults_from_the_right_mode() {
    let g = spec(QuantMode::Affine, 4, 32);
    // Same mode: unspecified fields come from the global spec.
    assert_eq!(ov("a=8").resolve(g).unwrap(), Some(spec(QuantMode::Affine, 8, 32)));
    // Another mode: from MLX's defaults for that mode.
    assert_eq!(ov("a=4::nvfp4").resolve(g).unwrap(), Some(spec(QuantMode::Nvfp4, 4, 16)));
    assert_eq!(ov("a=skip").resolve(g).unwrap(), None);
    // Bad combinations name the override and the combination.
    let e = ov("feed_forward.gate=8").resolve(spec(QuantMode::Mxfp4, 4, 32)).unwrap_err();
    assert!(e.message.contains("feed_forward.gate") && e.message.contains("mxfp4 with bits=8"), "{}", e.message);
}

#[test]
fn recipe_validation() {
    assert!(ConvertRecipe::quantized(QuantMode::Mxfp4, None, None).unwrap().quant == Some(spec(QuantMode::Mxfp4, 4, 32)));
    assert_eq!(ConvertRecipe::quantized(QuantMode::Nvfp4, None, None).unwrap().quant, Some(spec(QuantMode::Nvfp4, 4, 16)));
    for (m, b, g) in [(QuantMode::Mxfp4, 8, 32), (QuantMode::Nvfp4, 4, 32), (QuantMode::Affine, 7, 64), (QuantMode::Affine, 4, 16)] {
        let e = ConvertRecipe::quantized(m, Some(b), Some(g)).unwrap_err();
        assert!(e.message.contains(&format!("{} with bits={b} group_size={g} is not supported", m.name())), "{}", e.message);
    }
    let r = ConvertRecipe { overrides: vec![ov("a=8")], ..Default::default() };
    assert!(r.validate().unwrap_err().message.contains("needs a quantization mode"));
    let r = ConvertRecipe { dtype: Some(Dtype::Int32), ..Default::default() };
    assert!(r.validate().unwrap_err().message.contains("dtype int32"));
}

#[test]
fn pattern_matching() {
    let p = "model.layers.3.feed_forward.gate";
    assert!(pattern_matches("feed_forward.gate", p));
    assert!(pattern_matches(p, p));
    assert!(pattern_matches("gate", p));
    assert!(!pattern_matches("feed_forward.gate", "model.layers.3.feed_forward.gate_proj"));
    assert!(!pattern_matches("feed_forward.gate", "model.layers.3.feed_forward.switch_mlp.gate_proj"));
    assert!(!pattern_matches("ward.gate", p), "a suffix must start after a dot");
    assert!(pattern_matches("model.layers.3.*", p));
    assert!(!pattern_matches("model.layers.3.*", "model.layers.31.conv.in_proj"));
    assert!(pattern_matches("*.self_attn.*_proj", "model.layers.2.self_attn.q_proj"));
    assert!(pattern_matches("switch_mlp.*", "model.layers.4.feed_forward.switch_mlp.down_proj"));
    assert!(pattern_matches("*", "lm_head"));
    assert!(pattern_matches("embed_tokens", "model.embed_tokens"));
    assert!(!pattern_matches("embed", "model.embed_tokens"));
}

fn moe_modules() -> Vec<(String, usize)> {
    // hidden 64, moe width 32, dense width 128, as the tiny-moe preset.
    vec![
        ("model.embed_tokens".into(), 64),
        ("model.layers.0.conv.in_proj".into(), 64),
        ("model.layers.0.feed_forward.down_proj".into(), 128),
        ("model.layers.2.self_attn.v_proj".into(), 64),
        ("model.layers.2.feed_forward.gate".into(), 64),
        ("model.layers.2.feed_forward.switch_mlp.gate_proj".into(), 64),
        ("model.layers.2.feed_forward.switch_mlp.down_proj".into(), 32),
    ]
}

fn by_path(d: &[ModuleDecision]) -> BTreeMap<String, ModuleDecision> {
    d.iter().map(|x| (x.path.clone(), x.clone())).collect()
}

#[test]
fn module_selection_follows_mlx_lm() {
    let m = moe_modules();
    // affine 4 / group 64: the 32-wide expert down_proj is left alone; the
    // router gets the model predicate's 8-bit entry (no mode = affine).
    let d = by_path(&plan_quantization(ModelType::Lfm2Moe, &m, &recipe(spec(QuantMode::Affine, 4, 64), &[])).unwrap());
    let down = &d["model.layers.2.feed_forward.switch_mlp.down_proj"];
    assert_eq!(down.spec, None);
    assert!(down.reason.as_ref().unwrap().contains("input width 32 is not a multiple of the group size 64"));
    assert_eq!(d["model.embed_tokens"].spec, Some(spec(QuantMode::Affine, 4, 64)));
    assert_eq!(d["model.embed_tokens"].entry, None);
    let gate = &d["model.layers.2.feed_forward.gate"];
    assert_eq!(gate.spec, Some(spec(QuantMode::Affine, 8, 64)));
    assert_eq!(gate.entry, Some(json!({"group_size": 64, "bits": 8})));

    // nvfp4: everything divides 16; the router stays affine 8/64.
    let d = by_path(&plan_quantization(ModelType::Lfm2Moe, &m, &recipe(spec(QuantMode::Nvfp4, 4, 16), &[])).unwrap());
    assert!(d.values().all(|x| x.spec.is_some()));
    assert_eq!(d["model.layers.2.feed_forward.gate"].spec, Some(spec(QuantMode::Affine, 8, 64)));
    assert_eq!(d["model.layers.2.feed_forward.switch_mlp.down_proj"].spec, Some(spec(QuantMode::Nvfp4, 4, 16)));

    // A dense model has no router predicate: a `gate`-named module would be global.
    let dense = vec![("model.layers.0.feed_forward.w1".to_string(), 64)];
    let d = plan_quantization(ModelType::Lfm2, &dense, &recipe(spec(QuantMode::Mxfp8, 8, 32), &[])).unwrap();
    assert_eq!(d[0].spec, Some(spec(QuantMode::Mxfp8, 8, 32)));

    // mlx-lm checks divisibility with the global group: at group 128 the
    // 64-wide router is skipped even though its own group (64) would fit.
    let d = by_path(&plan_quantization(ModelType::Lfm2Moe, &m, &recipe(spec(QuantMode::Affine, 4, 128), &[])).unwrap());
    assert_eq!(d["model.layers.2.feed_forward.gate"].spec, None);
    assert_eq!(d["model.layers.0.feed_forward.down_proj"].spec, Some(spec(QuantMode::Affine, 4, 128)));

    // No quantization: every module is reported as kept.
    let d = plan_quantization(ModelType::Lfm2Moe, &m, &ConvertRecipe::default()).unwrap();
    assert!(d.iter().all(|x| x.spec.is_none() && x.entry.is_none()));
}

#[test]
fn overrides_win_over_the_model_predicate_and_the_last_match_wins() {
    let m = moe_modules();
    let r = recipe(
        spec(QuantMode::Affine, 4, 32),
        &["feed_forward.gate=8", "*.v_proj=8:32:mxfp8", "model.layers.0.*=skip", "model.layers.0.conv.in_proj=6"],
    );
    let d = by_path(&plan_quantization(ModelType::Lfm2Moe, &m, &r).unwrap());
    let gate = &d["model.layers.2.feed_forward.gate"];
    assert_eq!(gate.spec, Some(spec(QuantMode::Affine, 8, 32)));
    assert_eq!(gate.entry, Some(json!({"group_size": 32, "bits": 8, "mode": "affine"})));
    assert_eq!(d["model.layers.2.self_attn.v_proj"].spec, Some(spec(QuantMode::Mxfp8, 8, 32)));
    assert_eq!(d["model.layers.0.feed_forward.down_proj"].spec, None);
    assert!(d["model.layers.0.feed_forward.down_proj"].reason.as_ref().unwrap().contains("skipped by override `model.layers.0.*`"));
    assert_eq!(d["model.layers.0.conv.in_proj"].spec, Some(spec(QuantMode::Affine, 6, 32)));
    assert_eq!(d["model.embed_tokens"].spec, Some(spec(QuantMode::Affine, 4, 32)));

    // A pattern that matches nothing is a mistake worth reporting.
    let e = plan_quantization(ModelType::Lfm2Moe, &m, &recipe(spec(QuantMode::Affine, 4, 32), &["feedforward.gate=8"])).unwrap_err();
    assert!(e.message.contains("`feedforward.gate` matches no quantizable module"), "{}", e.message);
    // An override group that does not divide the module's width.
    let e = plan_quantization(ModelType::Lfm2Moe, &m, &recipe(spec(QuantMode::Affine, 4, 32), &["switch_mlp.down_proj=4:64"]))
        .unwrap_err();
    assert!(e.message.contains("`model.layers.2.feed_forward.switch_mlp.down_proj` has input width 32"), "{}", e.message);
}

#[test]
fn config_blocks_in_mlx_lm_format() {
    let m = moe_modules();
    let g = spec(QuantMode::Mxfp4, 4, 32);
    let d = plan_quantization(ModelType::Lfm2Moe, &m, &recipe(g, &["embed_tokens=8:64:affine"])).unwrap();
    let q = quantization_block(g, &d);
    assert_eq!(
        Value::Object(q.clone()),
        json!({
            "group_size": 32, "bits": 4, "mode": "mxfp4",
            "model.embed_tokens": {"group_size": 64, "bits": 8, "mode": "affine"},
            "model.layers.2.feed_forward.gate": {"group_size": 64, "bits": 8},
        })
    );
    let keys: Vec<&String> = q.keys().collect();
    assert_eq!(keys[..3], ["group_size", "bits", "mode"]);

    let mut src = Map::new();
    src.insert("model_type".into(), json!("lfm2_moe"));
    src.insert("_name_or_path".into(), json!("somewhere"));
    src.insert("vocab_size".into(), json!(1024));
    let c = output_config(&src, Some(q.clone()));
    assert_eq!(c.keys().collect::<Vec<_>>(), ["model_type", "quantization", "quantization_config", "vocab_size"]);
    assert_eq!(c["quantization"], c["quantization_config"]);
    let c = output_config(&src, None);
    assert_eq!(c.keys().collect::<Vec<_>>(), ["model_type", "vocab_size"]);
}

#[test]
fn expected_tensors_and_renames() {
    let f = FixtureSpec::new(Preset::TinyMoe);
    let cfg = ModelConfig::from_map(fixture::config_json(&f).as_object().unwrap().clone()).unwrap();
    let t = expected_tensors(&cfg);
    let modules = t.iter().filter(|x| x.module.is_some()).count();
    // embed + 4 conv layers x 2 + 2 attention x 4 + 2 dense MLPs x 3 + 4 MoE x (router + 3 switch).
    assert_eq!(modules, 1 + 8 + 8 + 6 + 16);
    assert!(t.iter().any(|x| x.name == "model.layers.0.feed_forward.gate_proj.weight"));
    assert!(t.iter().any(|x| x.name == "model.layers.0.conv.conv.weight" && x.shape == [64, 3, 1]));
    assert_eq!(sanitized_name(ModelType::Lfm2Moe, "model.layers.3.feed_forward.experts.7.w2.weight"), "model.layers.3.feed_forward.experts.7.down_proj.weight");
    assert_eq!(sanitized_name(ModelType::Lfm2, "model.layers.0.feed_forward.w2.weight"), "model.layers.0.feed_forward.w2.weight");
}

fn tmp(tag: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("mlx_lfm_convert_{tag}_{}", std::process::id()));
    let _ = fs::remove_dir_all(&p);
    p
}

#[test]
fn converts_hf_moe_and_loads() {
    let src = tmp("src_moe");
    let mut f = FixtureSpec::new(Preset::TinyMoe);
    f.layout = Layout::Hf;
    fixture::generate(&f, &src).unwrap();
    let out = tmp("out_moe");
    let mut r = ConvertRecipe::quantized(QuantMode::Mxfp4, None, None).unwrap();
    r.dtype = Some(Dtype::Bfloat16);
    let rep = convert(&src, &out, &r).unwrap();
    assert_eq!(rep.source_layout, "hf");
    assert_eq!(rep.dtype, "bfloat16");
    assert_eq!(rep.formats, vec![(spec(QuantMode::Affine, 8, 64), 4), (spec(QuantMode::Mxfp4, 4, 32), 35)]);
    assert!(rep.copied_files.contains(&"tokenizer.json".to_string()));
    let loaded = load_model(&out, &LoadOptions::default()).unwrap();
    assert!(loaded.unused_tensors.is_empty(), "{:?}", loaded.unused_tensors);
    assert_eq!(loaded.model.registry.len(), 39);
    assert_eq!(loaded.model.dtype, Dtype::Bfloat16);

    // The output directory must be new or empty; a failed run leaves nothing.
    let e = convert(&src, &out, &r).unwrap_err();
    assert!(e.message.contains("already exists and is not empty"), "{}", e.message);
    let out2 = tmp("out_moe_bad");
    let bad = ConvertRecipe { overrides: vec![ov("switch_mlp.down_proj=4:64")], ..r.clone() };
    assert!(convert(&src, &out2, &bad).is_err());
    assert!(!out2.exists(), "a failed conversion left {}", out2.display());
    // An already-quantized source is refused.
    let e = convert(&out, &out2, &r).unwrap_err();
    assert!(e.message.contains("already quantized"), "{}", e.message);
    let e = convert(&tmp("nowhere"), &out2, &r).unwrap_err();
    assert!(e.message.contains("is not a directory"), "{}", e.message);
    for d in [src, out, out2] {
        let _ = fs::remove_dir_all(d);
    }
}

#[test]
fn shards_like_mlx_lm_and_keeps_an_mlx_layout_source() {
    let src = tmp("src_dense_mlx");
    let mut f = FixtureSpec::new(Preset::Tiny);
    f.layout = Layout::Mlx;
    f.max_shard_bytes = Some(300_000);
    fixture::generate(&f, &src).unwrap();
    let out = tmp("out_dense_sharded");
    let r = ConvertRecipe { max_shard_bytes: Some(200_000), ..Default::default() };
    let rep = convert(&src, &out, &r).unwrap();
    assert_eq!(rep.source_layout, "mlx");
    assert_eq!(rep.dtype, "float32");
    assert_eq!(rep.quantization, None);
    assert!(rep.formats.is_empty());
    let shards: Vec<&String> = rep.files.iter().filter(|f| f.ends_with(".safetensors")).collect();
    assert!(shards.len() > 1, "{:?}", rep.files);
    assert!(shards[0].starts_with("model-00001-of-"), "{:?}", shards);
    let cfg: Value = serde_json::from_str(&fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert!(cfg.get("quantization").is_none());
    let loaded = load_model(&out, &LoadOptions::default()).unwrap();
    assert!(loaded.unused_tensors.is_empty());
    assert!(loaded.model.registry.is_empty());
    assert_eq!(loaded.weight_files.len(), shards.len());
    for d in [src, out] {
        let _ = fs::remove_dir_all(d);
    }
}
