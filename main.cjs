'use strict';
// The package's entry: picks the native flavour (lib/backend.cjs), then
// exposes napi-rs's generated bindings (index.cjs, typed by index.d.cts),
// with mlxInfo() saying which package loaded and why.
const [binding, choice] = require('./lib/backend.cjs').load();

const mlxInfo = binding.mlxInfo;
module.exports = {
  ...binding,
  mlxInfo() {
    return { ...mlxInfo(), binding: choice.package, bindingReason: choice.reason };
  },
};
