// The selector conformance suite (tests/selectors/conformance.hpp) on the CPU: one line per selector. The cases
// (configurations, extra prepare inputs) are defined in conformance.hpp, shared with the CUDA instantiation
// (tests/cuda/test_cuda_conformance.cpp).
#include "kvsift/cpu/backend.hpp"
#include "selectors/conformance.hpp"

namespace kvsift::test::conformance {
namespace {

INSTANTIATE_TYPED_TEST_SUITE_P(OracleTopK, Conformance, OnCpu<OracleTopKCase>);
INSTANTIATE_TYPED_TEST_SUITE_P(Quest, Conformance, OnCpu<QuestCase>);
INSTANTIATE_TYPED_TEST_SUITE_P(RerankedQuest, Conformance, OnCpu<RerankedQuestCase>);
INSTANTIATE_TYPED_TEST_SUITE_P(RerankedMassQuest, Conformance, OnCpu<RerankedMassQuestCase>);
INSTANTIATE_TYPED_TEST_SUITE_P(StreamingLLM, Conformance, OnCpu<StreamingLLMCase>);
INSTANTIATE_TYPED_TEST_SUITE_P(Ctkvr, Conformance, OnCpu<CtkvrCase>);
INSTANTIATE_TYPED_TEST_SUITE_P(Csattention, Conformance, OnCpu<CsattentionCase>);
INSTANTIATE_TYPED_TEST_SUITE_P(RerankedCsattention, Conformance, OnCpu<RerankedCsattentionCase>);
INSTANTIATE_TYPED_TEST_SUITE_P(A2ats, Conformance, OnCpu<A2atsCase>);
INSTANTIATE_TYPED_TEST_SUITE_P(RerankedA2ats, Conformance, OnCpu<RerankedA2atsCase>);
INSTANTIATE_TYPED_TEST_SUITE_P(CentroidKV, Conformance, OnCpu<CentroidKVCase>);
INSTANTIATE_TYPED_TEST_SUITE_P(SpeContext, Conformance, OnCpu<SpeContextCase>);

}  // namespace
}  // namespace kvsift::test::conformance
