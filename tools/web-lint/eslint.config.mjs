// ESLint for the live page's script (dpstream/web/page.js): a classic browser script, inlined.
import js from "@eslint/js";
import globals from "globals";

// The page defines its own `when` (a release's time or step); `globals` lists a browser
// global of that name, which would make no-redeclare report the page's function.
const {when: _when, ...browser} = globals.browser;

export default [
  js.configs.recommended,
  {
    files: ["**/*.js"],
    languageOptions: {
      ecmaVersion: 2022,
      sourceType: "script",
      // __POLL__ is replaced by the poll interval (ms) when the page is assembled
      globals: {...browser, __POLL__: "readonly"},
    },
    rules: {
      // W, H, L, R, T, B: a chart's geometry, declared together even where one is not used
      "no-unused-vars": ["error", {varsIgnorePattern: "^[WHLRTB]$"}],
      "no-var": "error",
      "prefer-const": "error",
      "eqeqeq": "error",
    },
  },
];
